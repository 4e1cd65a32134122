"""Sequential write and cold-read throughput of one big file, side by side.

Tools, in one run, interleaved (each repetition visits every tool and
configuration in turn, rotating the order), medians reported:

* zfunc's AsyncIO, for each native back end that runs here (and, with
  ``--python``, the pure-Python fallback);
* DeepSpeed's async I/O handle (``AsyncIOBuilder().load().aio_handle``, built
  with DS_ACCELERATOR=cpu), when deepspeed is importable;
* fio (``--direct=1``, io_uring and libaio engines), when installed;
* plain Python unbuffered file I/O, 8 MiB chunks, write + fsync.

Each tool moves its own allocator's buffer, as its users would: zfunc's
``aio.aligned_empty`` (transparent huge pages for large buffers), DeepSpeed's
page-locked tensor (``--shared-buffer``: every tool uses DeepSpeed's).
Every tool writes a fresh file (deleted first; ``--overwrite``: rewrites one
existing file, as a reused swap file) with O_DIRECT and, unless ``--fsync``
is given, no final fsync (the Python row always fsyncs: its writes
are buffered). Reads are cold as far as the guest can make them:
``posix_fadvise(DONTNEED)`` first (drop_caches is not permitted here).

    python benchmarks/aio.py                 # 4 GiB, 1 and 8 MiB blocks, qd 8 and 32
    python benchmarks/aio.py --size 1G --repeats 5

Prints a markdown table: median GB/s of each tool, and its ratio to the
anchor (DeepSpeed's handle at the same block size and queue depth when
present, else the better fio engine), taken within each repetition and given
as the median and range over repetitions: the virtual disk drifts between
repetitions by more than the tools differ within one.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from zfunc.ops import aio

GB = 1e9


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = text.strip().lower().rstrip("ib").rstrip("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fmt_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


OVERWRITE = False  # --overwrite: write into the existing, allocated file instead


def remove(path: str) -> None:
    if OVERWRITE:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Sampler:
    """Samples a strided subset of the buffer to check that reads return the data."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.expected = buf[::4093].clone()

    def scribble(self) -> None:
        self.buf[::4093] = 0

    def check(self, tool: str) -> None:
        if not torch.equal(self.buf[::4093], self.expected):
            raise RuntimeError(f"{tool}: data read back differs from what was written")


# ------------------------------------------------------------------ the tools

def zfunc_tool(backend: str, threads: int, fsync: bool):
    def run(buf, path, bs, qd, sampler):
        io = aio.AsyncIO(block_size=bs, queue_depth=qd, thread_count=threads, backend=backend,
                         check_space=False)
        remove(path)
        t = time.perf_counter()
        io.pwrite(buf, path, fsync=fsync)
        io.wait()
        w = time.perf_counter() - t
        drop_cache(path)
        sampler.scribble()
        t = time.perf_counter()
        io.pread(buf, path)
        io.wait()
        r = time.perf_counter() - t
        sampler.check(f"zfunc {backend}")
        io.close()
        return w, r
    return run


def deepspeed_tool(threads: int, fsync: bool):
    """DeepSpeed's handle, or None (and why) when deepspeed cannot be loaded."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        module = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # not installed, or its op does not build here
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def locked_buffer(nbytes):
        """A page-locked buffer from DeepSpeed's process-wide pin manager: its
        handle bounces every transfer through a fresh locked copy otherwise."""
        h = module.aio_handle(1 << 20, 8, False, True, threads)
        return h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8)), h

    def run(buf, path, bs, qd, sampler):
        h = module.aio_handle(bs, qd, False, True, threads)
        remove(path)
        t = time.perf_counter()
        h.async_pwrite(buf, path)
        h.wait()
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        w = time.perf_counter() - t
        drop_cache(path)
        sampler.scribble()
        t = time.perf_counter()
        h.async_pread(buf, path)
        h.wait()
        r = time.perf_counter() - t
        sampler.check("deepspeed")
        return w, r
    run.locked_buffer = locked_buffer
    return run, "loaded"


def fio_tool(engine: str, size: int, fsync: bool):
    def one(path, bs, qd, rw):
        cmd = ["fio", f"--name=zfunc_{rw}", f"--filename={path}", f"--ioengine={engine}",
               "--direct=1", f"--bs={bs}", f"--iodepth={qd}", f"--size={size}", f"--rw={rw}",
               "--numjobs=1", "--output-format=json"]
        if rw == "write" and fsync:
            cmd.append("--end_fsync=1")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0][rw]
        return size / job["bw_bytes"]  # seconds at fio's own measured rate

    def run(buf, path, bs, qd, sampler):
        remove(path)
        w = one(path, bs, qd, "write")
        drop_cache(path)
        r = one(path, bs, qd, "read")
        return w, r
    return run


def python_tool(chunk: int = 8 << 20):
    def run(buf, path, bs, qd, sampler):
        mv = memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
        remove(path)
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if OVERWRITE else os.O_TRUNC), 0o644)
        with open(fd, "wb", buffering=0) as f:
            for i in range(0, len(mv), chunk):
                f.write(mv[i:i + chunk])
            os.fsync(f.fileno())
        w = time.perf_counter() - t
        drop_cache(path)
        sampler.scribble()
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            for i in range(0, len(mv), chunk):
                f.readinto(mv[i:i + chunk])
        r = time.perf_counter() - t
        sampler.check("python")
        return w, r
    return run


# --------------------------------------------------------------------- main

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4G", help="file size (default 4G)")
    ap.add_argument("--dir", default="/tmp/zfunc_aio_bench", help="where the file goes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", default="1M,8M", help="block sizes")
    ap.add_argument("--depths", default="8,32", help="queue depths")
    ap.add_argument("--threads", type=int, default=1, help="thread_count / intra_op_parallelism")
    ap.add_argument("--backends", default=None,
                    help="zfunc back ends (default: every native one available)")
    ap.add_argument("--python", action="store_true", help="also the pure-Python back end")
    ap.add_argument("--fsync", action="store_true", help="fsync at the end of every write")
    ap.add_argument("--overwrite", action="store_true",
                    help="overwrite one existing file (as a reused swap file) instead of "
                         "writing a fresh one each time")
    ap.add_argument("--shared-buffer", action="store_true",
                    help="every tool uses DeepSpeed's locked buffer (default: each its own "
                         "allocator's; zfunc's aligned_empty uses huge pages)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--json", default=None, help="also write raw results here")
    ap.add_argument("--from-json", default=None,
                    help="print the table of a run saved with --json, measure nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        return report(saved["size"], saved["times"], saved.get("notes", []))

    global OVERWRITE
    size = parse_size(args.size)
    blocks = [parse_size(b) for b in args.blocks.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "bench.bin")
    remove(path)
    aio.check_free_space(path, size + (256 << 20))

    # (name, runner, per_config): per_config=False runs once per repetition
    tools: list[tuple[str, object, bool]] = []
    backends = (args.backends.split(",") if args.backends else
                [b for b in aio.available_backends() if b != "python"])
    if args.python:
        backends.append("python")
    for b in backends:
        tools.append((f"zfunc {b}", zfunc_tool(b, args.threads, args.fsync), True))
    notes = []
    if not args.no_deepspeed:
        ds, why = deepspeed_tool(args.threads, args.fsync)
        if ds is None:
            notes.append(f"DeepSpeed's handle not measured: {why}")
        else:
            tools.append(("deepspeed", ds, True))
    if not args.no_fio:
        if shutil.which("fio") is None:
            notes.append("fio not installed")
        else:
            for engine in ("io_uring", "libaio"):
                tools.append((f"fio {engine}", fio_tool(engine, size, args.fsync), True))
    tools.append(("python 8 MiB", python_tool(), False))

    # Each tool transfers from and to its own allocator's buffer, as its users
    # would: zfunc's aio.aligned_empty (huge pages), DeepSpeed's locked tensor
    # (its handle bounces through a fresh locked copy otherwise). With
    # --shared-buffer every tool uses DeepSpeed's (or, without it, zfunc's).
    ds = next((run for name, run, _ in tools if name == "deepspeed"), None)
    ds_buf = None
    if ds is not None:
        ds_buf, keep_alive = ds.locked_buffer(size)
        if ds_buf.data_ptr() % aio.ALIGNMENT:
            notes.append("DeepSpeed's locked buffer is not page aligned")
    own = ds_buf if args.shared_buffer and ds_buf is not None else aio.aligned_empty(size)
    pattern = torch.arange(size // 8, dtype=torch.int64)
    buffers = {}
    for buf in {id(b): b for b in (own, ds_buf) if b is not None}.values():
        buf.view(torch.int64)[: size // 8].copy_(pattern)
        buffers[id(buf)] = (buf, Sampler(buf))
    del pattern

    def buffer_of(name):
        return buffers[id(ds_buf if name == "deepspeed" else own)]

    buf = own
    if args.overwrite:
        with aio.AsyncIO(backend=aio.available_backends()[0], check_space=False) as io:
            io.pwrite(buf, path, fsync=True)
        OVERWRITE = True
    configs = [(bs, qd) for bs in blocks for qd in depths]
    times: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    print(f"# {fmt_size(size)} file in {args.dir}, {args.repeats} repetitions, "
          f"thread_count {args.threads}, fsync {'on' if args.fsync else 'off'}, "
          f"{'overwriting one file' if args.overwrite else 'fresh file per write'}, "
          f"{'one shared buffer' if args.shared_buffer else 'each tool its own buffer'}", flush=True)
    for rep in range(args.repeats):
        for ci, (bs, qd) in enumerate(configs):
            k = (rep + ci) % len(tools)
            for name, run, per_config in tools[k:] + tools[:k]:
                if not per_config and ci > 0:
                    continue
                key = (name, bs, qd) if per_config else (name, 0, 0)
                tool_buf, sampler = buffer_of(name)
                w, r = run(tool_buf, path, bs, qd, sampler)
                times.setdefault(key, []).append((w, r))
                print(f"  rep {rep} {name:16s} bs {fmt_size(bs) if per_config else '-':7s} "
                      f"qd {qd if per_config else '-':>2}: write {size / w / GB:5.2f} GB/s, "
                      f"read {size / r / GB:5.2f} GB/s", flush=True)
    OVERWRITE = False
    remove(path)
    entries = [dict(tool=n, block=bs, qd=qd, write_s=[t[0] for t in ts],
                    read_s=[t[1] for t in ts]) for (n, bs, qd), ts in times.items()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "repeats": args.repeats, "threads": args.threads,
                       "fsync": args.fsync, "notes": notes, "times": entries}, f, indent=1)
    report(size, entries, notes)


def report(size: int, entries: list[dict], notes: list[str]) -> None:
    """The table: median GB/s, and each tool's ratio to the anchor taken within each
    repetition (the anchor ran minutes apart at most), median and range over them."""
    times = {(e["tool"], e["block"], e["qd"]): (e["write_s"], e["read_s"]) for e in entries}

    def anchor(bs, qd):
        """Per-repetition (write, read) seconds of the anchor, and its name."""
        if ("deepspeed", bs, qd) in times:
            return times[("deepspeed", bs, qd)], "DeepSpeed"
        fio = [times[k] for k in times if k[0].startswith("fio") and k[1:] == (bs, qd)]
        if fio:  # the better fio engine in each repetition
            return tuple([min(ts) for ts in zip(*(f[i] for f in fio))] for i in (0, 1)), "best fio"
        return None

    def ratio(ours, theirs, name):
        rs = sorted(t / o for o, t in zip(ours, theirs))
        return f"{statistics.median(rs):.2f}x {name} ({rs[0]:.2f}-{rs[-1]:.2f})"

    print()
    print("| tool | block | queue depth | write GB/s | read GB/s | write vs anchor | read vs anchor |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    order = {e["tool"]: i for i, e in reversed(list(enumerate(entries)))}
    for (name, bs, qd) in sorted(times, key=lambda k: (k[1] == 0, k[1], k[2], order[k[0]])):
        w_s, r_s = times[(name, bs, qd)]
        w, r = size / statistics.median(w_s) / GB, size / statistics.median(r_s) / GB
        a = anchor(bs, qd) if bs else None
        ratio_w = ratio(w_s, a[0][0], a[1]) if a else ""
        ratio_r = ratio(r_s, a[0][1], a[1]) if a else ""
        print(f"| {name} | {fmt_size(bs) if bs else '8 MiB chunks'} | {qd or '-'} | "
              f"{w:.2f} | {r:.2f} | {ratio_w} | {ratio_r} |")
    for note in notes:
        print(f"\n{note}")

if __name__ == "__main__":
    main()
