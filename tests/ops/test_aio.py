"""Async file I/O (zfunc.ops.aio): round trips, errors, atomic writes, every back end."""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zfunc.ops import aio

BACKENDS = aio.available_backends()
KiB = 1024


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _buffer(n: int, misalign: int) -> torch.Tensor:
    """n bytes starting `misalign` bytes past a page boundary."""
    return aio.aligned_empty(n + misalign)[misalign:]


def _tobytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes (no numpy: it is not a dependency)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def _read_plain(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


def test_native_backends_built():
    """The io_uring and libaio back ends build wherever their headers are installed, and where
    they cannot, the reason names the missing header and the threads back end takes over.

    ``.ci/run`` installs liburing-dev and libaio-dev and sets ``ZFUNC_REQUIRE_NATIVE_AIO=1``,
    so in CI the extension must really build; a fresh machine without the headers checks
    the fallback and its reason instead.
    """
    status = aio.backend_status()
    if os.environ.get("ZFUNC_OPS_DISABLE", "").strip().lower() not in ("", "0", "false", "no"):
        assert BACKENDS == ["python"], BACKENDS  # every native op off: the PyTorch fallback alone
        return
    assert "threads" in BACKENDS, f"threads: {status['threads']}"
    assert BACKENDS[-1] == "python"
    missing = {b: status[b] for b in ("io_uring", "libaio") if b not in BACKENDS}
    if os.environ.get("ZFUNC_REQUIRE_NATIVE_AIO") == "1":
        assert not missing, missing
    for backend, why in missing.items():
        header = {"io_uring": "liburing.h", "libaio": "libaio.h"}[backend]
        assert header in why or "disabled" in why, f"{backend}: {why}"
    expected = "io_uring" if "io_uring" in BACKENDS else "libaio" if "libaio" in BACKENDS else "threads"
    assert aio.AsyncIO().backend == expected


def test_aligned_empty():
    for shape, dtype in [(1, torch.uint8), (4097, torch.uint8), ((3, 5), torch.float32),
                         ((2, 7, 9), torch.bfloat16), (0, torch.float64)]:
        t = aio.aligned_empty(shape, dtype)
        assert t.data_ptr() % aio.ALIGNMENT == 0
        assert t.dtype == dtype and t.is_contiguous()
        assert t.shape == ((shape,) if isinstance(shape, int) else shape)


def test_aligned_empty_large_buffers_start_on_a_huge_page():
    huge = aio._huge_page_size()
    for shape, dtype in [(4 * huge + 5, torch.uint8), ((3, huge + 1), torch.float32)]:
        t = aio.aligned_empty(shape, dtype, pin_memory=False)
        assert t.data_ptr() % (huge or aio.ALIGNMENT) == 0
        assert t.dtype == dtype and t.is_contiguous() and t.shape == ((shape,) if isinstance(shape, int) else shape)
        t.fill_(7)  # the advised range is all ours: writing every byte is fine
        assert int(t.view(-1)[-1]) == 7
    small = aio.aligned_empty(4 * 4096, pin_memory=False)
    big_plain = aio.aligned_empty(max(4 * huge, 1 << 23), huge_pages=False, pin_memory=False)
    assert small.data_ptr() % aio.ALIGNMENT == 0 and big_plain.data_ptr() % aio.ALIGNMENT == 0


# ------------------------------------------------------------------ round trips

layouts = st.lists(st.tuples(st.integers(0, 70_000),   # gap before the region
                             st.integers(0, 200_000),  # region size
                             st.integers(0, 4095)),    # buffer misalignment (0 = aligned)
                   min_size=1, max_size=12)
configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([4096, 8192, 64 * KiB]),
    "queue_depth": st.integers(1, 8),
    "thread_count": st.integers(1, 3),
    "single_submit": st.booleans(),
    "overlap_events": st.booleans(),
})


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, config=configs, seed=st.integers(0, 2**31 - 1))
def test_round_trip(tmp, backend, layout, config, seed):
    """Many unaligned regions written and read back, all in flight at once."""
    path = tmp / f"round_trip_{backend}.bin"
    if path.exists():
        path.unlink()
    expected = bytearray()
    regions = []
    for i, (gap, size, misalign) in enumerate(layout):
        offset = len(expected) + gap
        data = _random_bytes(size, seed + i)
        expected += bytes(gap) + _tobytes(data)
        src = _buffer(size, misalign)
        src.copy_(data)
        regions.append((offset, data, src, misalign))
    with aio.AsyncIO(backend=backend, **config) as io:
        for offset, _, src, _ in regions:
            io.pwrite(src, path, offset)
        assert io.wait() == len(regions)
        end = max([off + d.numel() for off, d, _, _ in regions if d.numel()], default=0)
        assert _read_plain(path) == bytes(expected[:end])
        outs = []
        for offset, data, _, misalign in regions:
            dst = _buffer(data.numel(), (misalign * 7) % 4096)
            dst.fill_(0xAB)
            io.pread(dst, path, offset)
            outs.append(dst)
        assert io.wait() == len(regions)
        assert io.poll() == 0
    for (offset, data, _, _), dst in zip(regions, outs):
        assert torch.equal(dst, data), f"region at offset {offset} differs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_multi_thread_round_trip(tmp, backend):
    """A multi-block transfer split across threads, typed tensor, byte slices."""
    x = aio.aligned_empty((3 * 1024 * 1024 + 7,), torch.float32)
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(0)))
    path = tmp / "big.bin"
    with aio.AsyncIO(block_size=256 * KiB, queue_depth=4, thread_count=3, backend=backend) as io:
        io.pwrite(x, path)
        io.wait()
        y = aio.aligned_empty(x.shape, x.dtype)  # huge pages where the kernel has them
        io.pread(y, path)
        # a byte slice of a tensor, at an unaligned file offset
        part = torch.zeros(1000 * 4 + 3, dtype=torch.uint8)
        io.pread(part, path, 12345)
        assert io.wait() == 2
    assert torch.equal(x, y)
    assert torch.equal(part, x.view(torch.uint8)[12345:12345 + part.numel()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_requests_in_flight(tmp, backend):
    n, size = 300, 5000
    data = _random_bytes(n * size, 1)
    with aio.AsyncIO(block_size=4096, queue_depth=16, thread_count=2, backend=backend) as io:
        for i in range(n):
            io.pwrite(data[i * size:(i + 1) * size], tmp / f"f{i % 7}", (i // 7) * size)
        assert io.wait() == n
        out = torch.empty_like(data)
        for i in range(n):
            io.pread(out[i * size:(i + 1) * size], tmp / f"f{i % 7}", (i // 7) * size)
        assert io.poll() <= n
        assert io.wait() == n
    assert torch.equal(out, data)


# ------------------------------------------------------------- atomic writes

@pytest.mark.parametrize("backend", BACKENDS)
def test_write_atomic_replaces(tmp, backend):
    path = tmp / "state.pt"
    path.write_bytes(b"old content that is longer than the new one" * 1000)
    new = _random_bytes(10_000, 2)
    with aio.AsyncIO(backend=backend) as io:
        io.write_atomic(new, path)
        assert io.wait() == 1
    assert _read_plain(path) == _tobytes(new)
    assert not (tmp / "state.pt.partial").exists()
    aio.write_file_atomic(path, new[:5], backend=backend)
    assert _read_plain(path) == _tobytes(new[:5])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("after", [0, 4096, 300_000])
def test_injected_enospc_leaves_no_complete_file(tmp, backend, after):
    path = tmp / "swap.bin"
    path.write_bytes(b"previous")
    data = aio.aligned_empty(600_000)
    data.copy_(_random_bytes(600_000, 3))
    other = tmp / "other.bin"
    with aio.AsyncIO(block_size=64 * KiB, thread_count=2, backend=backend) as io:
        io.inject_error(errno.ENOSPC, after_bytes=after)
        io.write_atomic(data, path)
        io.pwrite(data, other)  # an unrelated request still completes
        with pytest.raises(OSError) as info:
            io.wait()
    e = info.value
    assert e.errno == errno.ENOSPC
    assert e.filename == str(path)
    assert "No space left on device" in str(e) and "offset" in str(e)
    assert "was not written" in str(e)
    assert _read_plain(path) == b"previous"  # untouched
    assert not (tmp / "swap.bin.partial").exists()
    assert _read_plain(other) == _tobytes(data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_injected_eio_on_read(tmp, backend):
    path = tmp / "r.bin"
    path.write_bytes(bytes(range(256)) * 1000)
    out = torch.empty(256_000, dtype=torch.uint8)
    with aio.AsyncIO(block_size=8192, backend=backend) as io:
        io.inject_error(errno.EIO, after_bytes=100_000)
        io.pread(out, path, 0)
        with pytest.raises(OSError) as info:
            io.wait()
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(path)
        assert "while reading" in str(info.value) and "at offset" in str(info.value)
        # the handle keeps working after an error
        io.pread(out, path, 0)
        assert io.wait() == 1
    assert _tobytes(out) == _read_plain(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_failures_are_counted(tmp, backend):
    data = torch.ones(10_000, dtype=torch.uint8)
    with aio.AsyncIO(backend=backend) as io:
        io.inject_error(errno.EIO)
        io.pwrite(data, tmp / "a")
        io.inject_error(errno.EIO)
        io.pwrite(data, tmp / "b")
        with pytest.raises(OSError, match="1 more failed request"):
            io.wait()


@pytest.fixture
def tiny_fs():
    """A 1 MiB tmpfs, if this process may mount one (root in CI); else skip."""
    d = tempfile.mkdtemp(prefix="zfunc_tinyfs_")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()}); "
                    "ENOSPC is covered by fault injection")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_enospc(tiny_fs, backend):
    path = os.path.join(tiny_fs, "big.bin")
    with open(path, "wb") as f:
        f.write(b"keep me")
    data = aio.aligned_empty(3 * 1024 * 1024)
    data.fill_(7)
    # the kernel's own ENOSPC, past the up-front check
    with aio.AsyncIO(block_size=64 * KiB, backend=backend, check_space=False) as io:
        io.write_atomic(data, path)
        with pytest.raises(OSError) as info:
            io.wait()
    assert info.value.errno == errno.ENOSPC, info.value
    assert info.value.filename == path and "offset" in str(info.value)
    assert _read_plain(path) == b"keep me"
    assert os.listdir(tiny_fs) == ["big.bin"]
    # the up-front statvfs check catches it before any byte is written
    with aio.AsyncIO(backend=backend) as io:
        with pytest.raises(OSError, match="more than the") as info:
            io.pwrite(data, os.path.join(tiny_fs, "plain.bin"))
        assert info.value.errno == errno.ENOSPC
    assert os.listdir(tiny_fs) == ["big.bin"]


def test_check_free_space(tmp):
    aio.check_free_space(tmp / "x", 1)
    with pytest.raises(OSError) as info:
        aio.check_free_space(tmp / "x", 1 << 62)
    assert info.value.errno == errno.ENOSPC and str(tmp / "x") in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        aio.check_free_space(tmp / "missing" / "x", 1)


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [0, 100, 4096])
def test_short_read_names_file_and_offset(tmp, backend, offset):
    path = tmp / "short.bin"
    path.write_bytes(b"x" * 5000)
    with aio.AsyncIO(backend=backend) as io:
        with pytest.raises(EOFError) as info:
            io.pread(torch.empty(8192, dtype=torch.uint8), path, offset)
        assert io.poll() == 0
    msg = str(info.value)
    assert str(path) in msg and f"offset {offset}" in msg and "5000 bytes" in msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_directory(tmp, backend):
    t = torch.zeros(10, dtype=torch.uint8)
    missing = tmp / "no" / "such" / "file.bin"
    with aio.AsyncIO(backend=backend, check_space=False) as io:
        with pytest.raises(FileNotFoundError) as info:
            io.pwrite(t, missing)
        assert info.value.filename == str(missing)
        assert f"directory '{tmp / 'no' / 'such'}' does not exist" in str(info.value)
        with pytest.raises(FileNotFoundError, match="does not exist"):
            io.write_atomic(t, missing)
        with pytest.raises(FileNotFoundError) as info:
            io.pread(t, missing)
        assert info.value.filename == str(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        aio.AsyncIO(backend=backend).pwrite(t, missing)  # with the space check


def test_bad_arguments(tmp):
    with pytest.raises(ValueError, match="multiple of 4096"):
        aio.AsyncIO(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        aio.AsyncIO(queue_depth=0)
    with pytest.raises(ValueError, match="unknown aio backend"):
        aio.AsyncIO(backend="spdk")
    io = aio.AsyncIO()
    with pytest.raises(ValueError, match="contiguous"):
        io.pwrite(torch.zeros(4, 4).t(), tmp / "x")
    with pytest.raises(TypeError):
        io.pwrite(b"bytes", tmp / "x")
    with pytest.raises(ValueError, match="offset"):
        io.pwrite(torch.zeros(4), tmp / "x", -1)
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_plain_write_does_not_grow_file(tmp, backend):
    path = tmp / "plain.bin"
    path.write_bytes(b"abc")
    data = aio.aligned_empty(1 << 20)
    with aio.AsyncIO(block_size=64 * KiB, backend=backend) as io:
        io.inject_error(errno.EIO)
        io.pwrite(data, path, 4096)
        with pytest.raises(OSError, match="Input/output error while writing"):
            io.wait()
    assert path.stat().st_size == 3


def test_from_deepspeed_config():
    io = aio.AsyncIO.from_config({"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 2,
                                  "single_submit": True, "overlap_events": False,
                                  "use_gds": False}, backend="python")
    assert (io.block_size, io.queue_depth, io.thread_count) == (65536, 4, 2)
    assert io.single_submit and not io.overlap_events
    io.close()
    with pytest.raises(ValueError, match="did you mean 'queue_depth'"):
        aio.AsyncIO.from_config({"queue_dept": 8})
    with pytest.raises(ValueError, match="GPUDirect"):
        aio.AsyncIO.from_config({"use_gds": True})


_QUIET_CHECKPOINT = """
import os, sys, warnings
warnings.simplefilter("always")  # every warning reaches stderr, however often
from zfunc.ops import builder

probe = builder._probe
def absent(cxx, code, args):  # liburing.h and libaio.h faked absent, whatever this machine has
    return "fatal error: faked absent" if "liburing.h" in code or "libaio.h" in code else probe(cxx, code, args)
builder._probe = absent

import torch
import zfunc as zf
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
def loss_fn(params, x):
    return zf.apply(model, params, x).sum()
step = zf.zero3(zf.train_step(loss_fn, zf.optim.sgd(0.1)))
state = step.init(model, free_model=False)
state, _ = step(state, torch.ones(2, 4))
zf.checkpoint.save(state, sys.argv[1], "t")
zf.checkpoint.load(step.init(model, free_model=False), sys.argv[1])
print("--- nvme ---", file=sys.stderr, flush=True)
for i in range(2):
    nvme = zf.zero3(zf.offload_nvme(zf.train_step(loss_fn, zf.optim.sgd(0.1)), os.path.join(sys.argv[1], f"swap{i}")))
    with nvme.init(model, free_model=False) as s:
        s, _ = nvme(s, torch.ones(2, 4))
print("done", file=sys.stderr)
"""


def test_a_checkpoint_says_nothing_about_back_ends_and_the_nvme_swap_says_once(tmp_path):
    """A save and load of an in-memory zero3 state builds no aio back end and prints nothing about
    any (a user who never asked for NVMe has nothing to wonder about); the NVMe swap, which asks,
    says once which back end it took and why the faster ones are missing. The native back ends
    are faked absent (their headers) and the threads one disabled, so nothing is compiled."""
    env = dict(os.environ, ZFUNC_OPS_DISABLE="aio_threads", ZFUNC_CPU_ALLOCATOR="0")
    r = subprocess.run([sys.executable, "-c", _QUIET_CHECKPOINT, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stderr.rstrip().endswith("done"), r.stderr[-3000:]
    checkpoint, nvme = r.stderr.split("--- nvme ---")
    for word in ("liburing", "libaio", "aio", "back end", "native op", "Warning"):
        assert word not in checkpoint, checkpoint
    assert nvme.count("zfunc aio: file I/O for the NVMe swap uses the 'python' back end") == 1, nvme
    assert "io_uring is not available: header 'liburing.h' not found" in nvme
    assert "libaio is not available: header 'libaio.h' not found" in nvme
    assert "threads" not in nvme  # disabled on purpose: not a reason to report


def test_loaded_backend_builds_nothing(monkeypatch):
    """Before any auto choice, loaded_backend is "python" and builds nothing; after, the one chosen."""
    monkeypatch.setattr(aio, "_status", {})
    monkeypatch.setattr(aio.builder, "load", lambda *a, **k: pytest.fail("loaded_backend built an op"))
    assert aio.loaded_backend() == "python"
    monkeypatch.setattr(aio, "_status", {"io_uring": (None, "header 'liburing.h' not found"),
                                         "libaio": (object(), "built")})
    assert aio.loaded_backend() == "libaio"
