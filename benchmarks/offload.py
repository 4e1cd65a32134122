"""Offload side by side: zfunc zero3, zero3(offload_cpu), zero3(offload_nvme) against DeepSpeed's
ZeRO-3, ZeRO-Offload and ZeRO-Infinity modes, in one run; and a scale run.

    python benchmarks/offload.py                       # the anchor GPT, W=2 gloo ranks, fp32
    python benchmarks/offload.py --precision bf16      # bf16 compute, fp32 master weights
    python benchmarks/offload.py --repeats 3           # modes interleaved 3 times, medians
    python benchmarks/offload.py --scale               # model states 1.5x RAM, zero3(offload_nvme), W=1, 3 steps

Each mode runs in its own fresh processes (benchmarks/_modes.py's worker), so peak RSS
per rank is its own. Disk traffic per step is read from /proc/self/io (bytes that reached the
block layer, all threads) in every mode alike. "I/O s" is that traffic at the bandwidth
zfunc's aio handle measures here at the start of the run (a 1 GiB O_DIRECT write, then a
cold read); "hidden" is the share of that I/O time the step did not pay for:
(compute-only time + I/O s - step time) / I/O s, where compute-only time is the same
library's ZeRO-3 without offload in the same repeat.

--scale trains a GPT (d_model 2048, as many layers as it takes) whose model states in fp32
Adam (16 bytes per parameter) are at least 1.5x this machine's RAM for 3 steps under
zero3(offload_nvme) at W=1 and reports its peak RSS, step times and disk bandwidth. It
needs about 20 bytes per parameter free on --nvme-path's disk.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from zfunc.testing import memory

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import _modes  # noqa: E402
from _launch import driver_or_worker, launch  # noqa: E402
from _peers import PEERS, lm_loss  # noqa: E402
from _worker import disk_io_bytes  # noqa: E402

MODES = ["zero3", "zero3_cpu", "zero3_cpu_overlap", "zero3_nvme", "zero3_nvme_noprefetch", "zero3_nvme_small", "ds3", "ds3_cpu", "ds3_nvme"]
PEER = {"zero3": "ds3", "zero3_cpu": "ds3_cpu", "zero3_cpu_overlap": "ds3_cpu", "zero3_nvme": "ds3_nvme", "zero3_nvme_small": "ds3_nvme",
        "zero3_nvme_noprefetch": "ds3_nvme", "zero3_nvme_small_noprefetch": "ds3_nvme"}
COMPUTE = {"zero3_cpu": "zero3", "zero3_cpu_overlap": "zero3", "zero3_nvme": "zero3", "zero3_nvme_small": "zero3", "zero3_nvme_noprefetch": "zero3",
           "zero3_nvme_small_noprefetch": "zero3",
           "ds3_cpu": "ds3", "ds3_nvme": "ds3"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nvme-path", default=None, help="folder for swap files (default: under $TMPDIR)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank (smaller: the step is more I/O-bound)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true", help="a tiny model, for smoke testing")
    p.add_argument("--json", default=None)
    p.add_argument("--scale", action="store_true", help="the scale run instead of the table")
    p.add_argument("--scale-ratio", type=float, default=1.5, help="model states / RAM for --scale")
    p.add_argument("--scale-steps", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the scale run's process: its result file
    return p.parse_args()


# ---------------------------------------------------------------- disk bandwidth


def measure_bandwidth(folder: str) -> tuple[float, float]:
    """(write, read) GB/s of zfunc's default aio handle here, measured in a child process (so
    its 1 GiB buffer never enters this one's memory)."""
    import subprocess

    code = f"import sys; sys.path.insert(0, {HERE!r}); import offload; print(*offload._bandwidth({folder!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    write, read = map(float, out.split()[-2:])
    return write, read


def _bandwidth(folder: str, nbytes: int = 1 << 30) -> tuple[float, float]:
    from zfunc.ops import aio

    path = os.path.join(folder, "bandwidth.probe")
    buf = aio.aligned_empty(nbytes)
    buf.fill_(1)
    with aio.AsyncIO() as h:
        t0 = time.perf_counter()
        h.pwrite(buf, path, fsync=True)
        h.wait()
        write = nbytes / (time.perf_counter() - t0) / 1e9
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        t0 = time.perf_counter()
        h.pread(buf, path)
        h.wait()
        read = nbytes / (time.perf_counter() - t0) / 1e9
    os.unlink(path)
    return write, read


# ---------------------------------------------------------------- the side-by-side table


def table(results, args, bandwidth):
    write_bw, read_bw = bandwidth
    modes = [m for m in args.modes.split(",") if results.get(m)]

    def med(m, key):
        return statistics.median(r[key] for r in results[m])

    def ratio(m, other):
        return _modes.per_repeat_ratio(results, m, other) if other in modes else None

    def fmt(x, spec=".2f"):
        return "" if x is None else format(x, spec)

    lines = ["| mode | median step s | time / own ZeRO-3 | time / DeepSpeed's same mode | peak RSS per rank | "
             "RSS / DeepSpeed's same mode | read MB/step | written MB/step | I/O s at measured bandwidth | "
             "I/O hidden | loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in modes:
        step, rss = med(m, "median_step_s"), med(m, "peak_rss_bytes")
        read, written = med(m, "read_bytes"), med(m, "write_bytes")
        io_s = read / (read_bw * 1e9) + written / (write_bw * 1e9)
        own = COMPUTE.get(m, m)
        hidden = None
        if own != m and own in modes and io_s > 0:
            hidden = (med(own, "median_step_s") + io_s - step) / io_s
        peer = PEER.get(m)
        rss_ratio = rss / med(peer, "peak_rss_bytes") if peer in modes else None
        lines.append(f"| {PEERS[m].label} | {step:.3f} | {fmt(ratio(m, own))} | {fmt(ratio(m, peer) if peer else None)} | "
                     f"{rss / 1e9:.2f} GB | {fmt(rss_ratio)} | {read / 1e6:.1f} | {written / 1e6:.1f} | "
                     f"{io_s:.3f} | {fmt(hidden, '.0%')} | {results[m][0]['final_loss']:.6f} |")
    lines += prefetch_lines(results, modes)
    return "\n".join(lines)


def prefetch_lines(results, modes):
    """The coordinator's effect: each zfunc mode with prefetch against the same mode without it."""
    pairs = [(m, m + "_noprefetch") for m in modes if m + "_noprefetch" in modes]
    if not pairs:
        return []
    out = ["", "| mode | speed-up from prefetch (time off / on) | peak RSS / zfunc zero3 | misses per step after the first, on / off |",
           "| --- | ---: | ---: | ---: |"]
    for on, off in pairs:
        rss = statistics.median(r["peak_rss_bytes"] for r in results[on])
        base = statistics.median(r["peak_rss_bytes"] for r in results["zero3"]) if "zero3" in modes else None
        misses = [max(r.get("misses_after_first") or 0 for r in results[m]) for m in (on, off)]
        out.append(f"| {PEERS[on].label} | {_modes.per_repeat_ratio(results, off, on):.2f} | "
                   f"{'' if base is None else format(rss / base, '.2f')} | {misses[0]} / {misses[1]} |")
    return out


def main(args):
    zargs = ["--modes", args.modes, "--precision", args.precision, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq)] + (
                 ["--small"] if args.small else [])
    zv = _modes.parse_args(zargs)
    results = {m: [] for m in zv.modes}
    with tempfile.TemporaryDirectory(prefix="offload-bench.") as tmp:
        swap = args.nvme_path or os.path.join(tmp, "swap")
        os.makedirs(swap, exist_ok=True)
        zv.nvme_path = swap
        bandwidth = measure_bandwidth(swap)
        print(f"aio bandwidth on {swap}: write {bandwidth[0]:.2f} GB/s, read {bandwidth[1]:.2f} GB/s", file=sys.stderr)
        for repeat in range(args.repeats):
            for mode in zv.modes:
                out = _modes.run_mode(mode, zv, tmp, repeat)
                if out is not None:
                    results[mode].append(out)
    text = table(results, args, bandwidth)
    params = next(r for rs in results.values() for r in rs)["params"]
    print(f"\nGPT pre-LN, {zv.layers} layers, d_model {zv.width}, vocab {zv.vocab}, seq {zv.seq}, untied, "
          f"{params / 1e6:.1f}M params, {_modes.precision_text(args.precision)}, AdamW (lr {zv.lr}, wd {zv.wd}); "
          f"W={zv.world} gloo ranks x 1 thread, batch {zv.world} x {zv.batch}; {zv.warmup} warm-up + {zv.steps} timed "
          f"steps; median over {args.repeats} repeat(s); aio measured at write {bandwidth[0]:.2f} / read "
          f"{bandwidth[1]:.2f} GB/s; torch {torch.__version__}\n")
    print(text, flush=True)
    losses = {m: rs[0]["final_loss"] for m, rs in results.items() if rs}
    ref = losses.get("zero3", next(iter(losses.values())))
    tol = zv.tolerance
    bad = {m: v for m, v in losses.items() if abs(v - ref) > tol * abs(ref)}
    print(f"\nLoss check (relative {tol:g} against zfunc zero3): " + ("all agree" if not bad else f"MISMATCH {bad}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), bandwidth=bandwidth, results=results), f, indent=1)


# ---------------------------------------------------------------- the scale run


def scale_worker(args):
    import zfunc as zf
    from gpt import GPT, GPTConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    d, vocab, seq = 2048, 8192, 128
    per_block = 12 * d * d + 13 * d
    root = 2 * vocab * d + seq * d + 2 * d
    layers = max(1, -(-int(args.scale_ratio * ram / 16 - root) // per_block))
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=16, tie_embeddings=False)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())

    def init_fn(m):  # GPT-2's init, one module at a time
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)
        if isinstance(m, torch.nn.LayerNorm):
            m.reset_parameters()

    def loss_fn(params, batch):
        x, y = batch
        return lm_loss(zf.apply(model, params, x), y)

    step = zf.zero3(zf.offload_nvme(zf.train_step(loss_fn, zf.optim.adamw(1e-4)), args.nvme_path,
                                    sub_group_size=per_block))
    t0 = time.perf_counter()
    state = step.init(model, init_fn=init_fn)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(args.scale_steps):
        tokens = torch.randint(vocab, (1, seq + 1), generator=g)
        io0 = disk_io_bytes()
        t0 = time.perf_counter()
        state, metrics = step(state, (tokens[:, :-1], tokens[:, 1:]))
        loss = metrics["loss"].item()
        dt = time.perf_counter() - t0
        read, written = (b - a for a, b in zip(io0, disk_io_bytes()))
        rows.append(dict(step_s=dt, loss=loss, read=read, written=written, nvme=metrics["nvme"]))
        print(f"[scale] step {i}: {dt:.1f} s, loss {loss:.4f}, read {read / 1e9:.1f} GB, written "
              f"{written / 1e9:.1f} GB", file=sys.stderr, flush=True)
    report = zf.memory_report(state)
    state.close()
    out = dict(ram=ram, params=n, layers=layers, model_state_bytes=16 * n, init_s=init_s, rows=rows,
               disk_bytes=report["by_home"]["disk"], swap_buffer_bytes=report["swap_buffer_bytes"],
               peak_rss=memory.peak())
    with open(args.worker, "w") as f:
        json.dump(out, f)


def scale(args):
    with tempfile.TemporaryDirectory(prefix="offload-scale.") as tmp:
        swap = args.nvme_path or os.path.join(tmp, "swap")
        os.makedirs(swap, exist_ok=True)
        result = os.path.join(tmp, "scale.json")
        t0 = time.perf_counter()
        rcs = launch([os.path.abspath(__file__), "--worker", result, "--nvme-path", swap,
                      "--scale-ratio", str(args.scale_ratio), "--scale-steps", str(args.scale_steps)], 1,
                     env={"OMP_NUM_THREADS": str(os.cpu_count())})
        if any(rcs):
            sys.exit(f"scale run failed: exit code {rcs}")
        with open(result) as f:
            r = json.load(f)
    wall = time.perf_counter() - t0
    print(f"\nScale run: GPT d_model 2048, {r['layers']} layers, {r['params'] / 1e9:.2f}B parameters; model states "
          f"(fp32 Adam, 16 B/param) {r['model_state_bytes'] / 1e9:.1f} GB = {r['model_state_bytes'] / r['ram']:.2f}x "
          f"this machine's {r['ram'] / 1e9:.1f} GB RAM; zero3(offload_nvme), W=1, batch 1 x 128 tokens\n")
    print("| step | s | loss | read GB | written GB | disk GB/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, row in enumerate(r["rows"]):
        print(f"| {i} | {row['step_s']:.1f} | {row['loss']:.4f} | {row['read'] / 1e9:.1f} | {row['written'] / 1e9:.1f} | "
              f"{(row['read'] + row['written']) / row['step_s'] / 1e9:.2f} |")
    print(f"\npeak RSS {r['peak_rss'] / 1e9:.2f} GB = {r['peak_rss'] / r['ram']:.2f}x RAM (swap buffers "
          f"{r['swap_buffer_bytes'] / 1e9:.2f} GB); on disk {r['disk_bytes'] / 1e9:.1f} GB; init {r['init_s']:.0f} s; "
          f"whole run {wall / 60:.1f} min")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


def driver(args):
    (scale if args.scale else main)(args)


if __name__ == "__main__":
    driver_or_worker(parse_args, driver, scale_worker)
