"""Asynchronous file I/O between CPU tensors and files, for NVMe swapping.

``AsyncIO`` queues reads and writes of whole tensors (or byte slices of them:
``t.view(torch.uint8)[a:b]``) at byte offsets in files and returns at once;
``wait()`` blocks until they are done and raises if any failed, naming the
file, the offset and the cause. The configuration keys are DeepSpeed's
``aio`` section with the same meanings:

* ``block_size``: bytes per request handed to the kernel;
* ``queue_depth``: requests in flight per thread;
* ``thread_count``: threads a large transfer is split across;
* ``single_submit``: submit requests one by one instead of in batches;
* ``overlap_events``: keep the queue full (submit as requests finish) rather
  than submit a batch and wait for all of it.

Back ends, fastest first: ``io_uring`` (liburing), ``libaio``, ``threads``
(a pool doing pread/pwrite), each a C++ extension from ``csrc/aio`` compiled
when its headers and library exist, and ``python`` (a thread pool in plain
Python, zfunc.ops.python_aio) which always works. This module picks one and
fronts it. ``available_backends()`` lists what runs here.
Nothing is built at import: a back end is built when something asks for it
(``backend="auto"``: the NVMe swap, ``measure_disk``), and the first such
choice in a process says once, with an ``OpBuildWarning``, which back end it
took and why the faster ones are not available (a missing header, say); a
native back end that is not available is never announced on its own.
``loaded_backend()`` is the best one already built in this process, for work
that runs well without one and should not start a build (checkpoints).

Page-aligned parts of a transfer use O_DIRECT (bypassing the page cache);
unaligned heads and tails, and buffers whose address does not line up with the
file offset, go through ordinary buffered I/O, so any size and offset works.
``aligned_empty`` allocates tensors that take the fast path throughout.

A write that must never leave a complete-looking file behind when it fails
goes through ``write_atomic`` (or ``write_file_atomic``): the data goes to
``path + ".partial"``, which is fsynced and renamed to ``path`` only when every
block succeeded, and removed otherwise.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import math
import os
import threading
import warnings
from typing import Mapping, Sequence

import torch

from . import builder
from ._names import unknown
from .python_aio import PythonHandle

__all__ = [
    "ALIGNMENT", "BACKENDS", "AsyncIO", "aligned_empty", "available_backends",
    "backend_status", "check_free_space", "write_file_atomic",
]

ALIGNMENT = 4096
BACKENDS = ("io_uring", "libaio", "threads", "python")

# backend -> (op name for the builder, engine source, builder keywords)
_NATIVE = {
    "io_uring": ("aio_uring", "aio/engine_uring.cpp",
                 dict(extra_ldflags=["-luring"], required_headers=["liburing.h"],
                      required_libs=["uring"])),
    "libaio": ("aio_libaio", "aio/engine_libaio.cpp",
               dict(extra_ldflags=["-laio"], required_headers=["libaio.h"],
                    required_libs=["aio"])),
    "threads": ("aio_threads", "aio/engine_threads.cpp", dict(extra_ldflags=["-pthread"])),
}

_lock = threading.Lock()
_status: dict[str, tuple[object, str]] = {}  # backend -> (module or None, reason)
_graveyard: list[torch.Tensor] = []  # buffers a broken kernel queue may still touch


_reported = False  # whether the first auto choice was reported


def _native(backend: str):
    """The compiled module for a native back end, or None (reason in backend_status). Quiet: the
    choice among them is reported once (``_auto``), not each that is missing."""
    with _lock:
        if backend not in _status:
            op, engine, kw = _NATIVE[backend]
            module = builder.load(op, ["aio/aio_handle.cpp", engine], quiet=True, **kw)
            reason = "built"
            if module is None:
                row = next((r for r in builder.report() if r["name"] == op), None)
                reason = row["reason"] if row else "not built"
            else:
                why = module.probe()
                if why:
                    module, reason = None, f"built, but does not run here: {why}"
            _status[backend] = (module, reason)
        return _status[backend][0]


def _auto() -> str:
    """The first back end that works (later ones are not even built); the first time in this
    process, an ``OpBuildWarning`` names it and why each faster one is not available, unless
    it is the fastest or the faster ones were disabled on purpose (ZFUNC_OPS_DISABLE)."""
    global _reported
    backend = next(b for b in BACKENDS if b == "python" or _native(b) is not None)
    with _lock:
        if _reported:
            return backend
        _reported = True
        faster = {b: _status[b][1] for b in BACKENDS[:BACKENDS.index(backend)]}
    why = {b: r for b, r in faster.items() if not r.startswith("disabled")}
    if why:
        warnings.warn(f"zfunc aio: file I/O for the NVMe swap uses the {backend!r} back end; "
                      + "; ".join(f"{b} is not available: {r}" for b, r in why.items()),
                      builder.OpBuildWarning, stacklevel=3)
    return backend


def loaded_backend() -> str:
    """The fastest back end already built in this process (by the NVMe swap), else "python":
    builds nothing and says nothing."""
    with _lock:
        return next(b for b in BACKENDS if b == "python" or (b in _status and _status[b][0] is not None))


def available_backends() -> list[str]:
    """Back ends that work on this machine, fastest first; always ends with "python"."""
    return [b for b in BACKENDS if b == "python" or _native(b) is not None]


def backend_status() -> dict[str, str]:
    """For each back end, "built" or why it is not available."""
    available_backends()
    out = {b: _status[b][1] for b in _NATIVE}
    out["python"] = "always available"
    return out


# ------------------------------------------------------------------ buffers

def aligned_empty(shape: int | Sequence[int], dtype: torch.dtype = torch.uint8, *,
                  pin_memory: bool | None = None, huge_pages: bool | None = None) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a 4096-byte boundary.

    ``shape`` is as for ``torch.empty`` (with the default uint8, an int is a
    byte count). Over-allocates and slices. Pinned (page-locked) when CUDA is
    available, unless ``pin_memory`` says otherwise.

    Unpinned buffers of 8 MiB or more (``huge_pages=None``; True or False to
    choose) start on a huge-page boundary and ask the kernel for transparent
    huge pages (``madvise(MADV_HUGEPAGE)``, before anything touches them).
    Direct I/O then hands the disk a few physically contiguous pieces per
    request instead of one per 4 KiB page, so each request needs fewer
    block-layer requests: on the development VM, reads and writes of such a
    buffer ran about 30% faster. Where the kernel has no such pages the
    advice is ignored and the buffer is an ordinary one.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    nbytes = math.prod(shape) * dtype.itemsize
    huge = _huge_page_size() if not pin_memory else 0
    if huge_pages is None:
        huge_pages = bool(huge) and nbytes >= 4 * huge
    if not (huge_pages and huge):
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
        skip = (-raw.data_ptr()) % ALIGNMENT
        return raw[skip:skip + nbytes].view(dtype).view(shape)
    span = -(-nbytes // huge) * huge  # whole huge pages, so the advice covers only this buffer
    raw = torch.empty(span + huge, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % huge
    _madvise_huge(raw.data_ptr() + skip, span)
    return raw[skip:skip + nbytes].view(dtype).view(shape)


_MADV_HUGEPAGE = 14


def _huge_page_size() -> int:
    """The transparent huge page size, or 0 where the kernel offers none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return 0
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _madvise_huge(address: int, nbytes: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(address, nbytes, _MADV_HUGEPAGE)  # advice: a failure only means small pages
    except (OSError, AttributeError):
        pass


def _memory(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, nbytes) of a tensor's data, which must be CPU and contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"async file I/O needs a CPU tensor, got one on {tensor.device}; "
                         "copy it to a (pinned) CPU buffer first")
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError("async file I/O needs a contiguous tensor; call .contiguous() "
                         "or use a byte slice of a contiguous buffer")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


# --------------------------------------------------------------- free space

def check_free_space(path: str | os.PathLike, nbytes: int) -> None:
    """Raise OSError(ENOSPC) now if the file system holding ``path`` has fewer
    than ``nbytes`` bytes free for this user; FileNotFoundError if the
    directory ``path`` would live in does not exist."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.statvfs(directory)
    except FileNotFoundError:
        raise FileNotFoundError(_errno.ENOENT, f"No such file or directory: directory "
                                               f"'{directory}' does not exist", path) from None
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise OSError(_errno.ENOSPC,
                      f"No space left on device: writing {nbytes} bytes needs "
                      f"{nbytes - free} more than the {free} bytes free in '{directory}'",
                      path)


def _growth(path: str, offset: int, nbytes: int) -> int:
    """How many bytes writing [offset, offset + nbytes) adds to the file."""
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    return max(0, offset + nbytes - size)


# -------------------------------------------------------------------- API

class AsyncIO:
    """Queue tensor reads and writes against files; ``wait()`` for them.

    ``backend`` is "auto" (the first of ``available_backends()``) or one of
    ``BACKENDS``; asking for one that did not build here raises.
    ``check_space`` checks free space (statvfs) before each write that grows a
    file, so a write that cannot fit fails before it starts. The tensors
    passed in are kept alive until ``wait()`` returns; do not touch them
    before then.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, thread_count: int = 1,
                 single_submit: bool = False, overlap_events: bool = True,
                 backend: str = "auto", check_space: bool = True):
        for key, value in (("block_size", block_size), ("queue_depth", queue_depth),
                           ("thread_count", thread_count)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if block_size % ALIGNMENT:
            raise ValueError(f"block_size must be a multiple of {ALIGNMENT}, got {block_size} "
                             f"(nearest: {max(1, round(block_size / ALIGNMENT)) * ALIGNMENT})")
        if backend == "auto":  # the first that works; later ones are not even built
            backend = _auto()
        elif backend not in BACKENDS:
            raise ValueError(f"unknown aio backend {backend!r}; choose one of "
                             f"{', '.join(('auto',) + BACKENDS)}")
        args = (block_size, queue_depth, thread_count, bool(single_submit), bool(overlap_events))
        if backend == "python":
            self._impl = PythonHandle(*args)
        else:
            module = _native(backend)
            if module is None:
                raise RuntimeError(f"aio backend {backend!r} is not available here: "
                                   f"{_status[backend][1]}; available: {available_backends()}")
            try:
                self._impl = module.Handle(*args)
            except RuntimeError as e:  # e.g. io_setup: EAGAIN past fs.aio-max-nr
                raise RuntimeError(f"cannot create a {backend} aio handle with queue_depth "
                                   f"{queue_depth} x thread_count {thread_count}: {e}; "
                                   "use fewer handles, a smaller queue, or another "
                                   "backend") from e
        self.backend = backend
        self.block_size, self.queue_depth, self.thread_count = block_size, queue_depth, thread_count
        self.single_submit, self.overlap_events = bool(single_submit), bool(overlap_events)
        self.check_space = bool(check_space)
        self._held: list[torch.Tensor] = []
        self._growing = 0  # bytes queued writes add, for the free-space check

    _CONFIG_KEYS = ("block_size", "queue_depth", "thread_count", "intra_op_parallelism",
                    "single_submit", "overlap_events", "use_gds")

    @classmethod
    def from_config(cls, config: Mapping[str, object], **kw) -> "AsyncIO":
        """A handle from DeepSpeed's ``aio`` config section (``intra_op_parallelism``
        is accepted as the newer name of ``thread_count``). Unknown keys raise,
        naming the nearest valid one."""
        args: dict[str, object] = {}
        for key, value in config.items():
            if key not in cls._CONFIG_KEYS:
                raise ValueError(unknown(f"aio config key {key!r}", key, cls._CONFIG_KEYS, sep="; "))
            if key == "use_gds":
                if value:
                    raise ValueError("aio.use_gds: GPUDirect Storage is not supported; "
                                     "set it to false")
                continue
            args["thread_count" if key == "intra_op_parallelism" else key] = value
        return cls(**args, **kw)

    def __repr__(self) -> str:
        return (f"AsyncIO(backend={self.backend!r}, block_size={self.block_size}, "
                f"queue_depth={self.queue_depth}, thread_count={self.thread_count}, "
                f"single_submit={self.single_submit}, overlap_events={self.overlap_events})")

    # requests ---------------------------------------------------------------

    def pread(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> None:
        """Queue a read of ``tensor.nbytes`` bytes at ``offset`` of ``path`` into ``tensor``.
        Raises at once if the file cannot be opened or is too short."""
        addr, nbytes = _memory(tensor)
        self._impl.pread(addr, nbytes, os.fspath(path), offset)
        self._held.append(tensor)

    def pwrite(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0, *,
               fsync: bool = False) -> None:
        """Queue a write of ``tensor`` at ``offset`` of ``path`` (created if missing,
        never truncated). ``fsync=True`` makes it durable before ``wait()`` returns."""
        addr, nbytes = _memory(tensor)
        path = os.fspath(path)
        growth = _growth(path, offset, nbytes) if self.check_space else 0
        if growth:
            check_free_space(path, self._growing + growth)
        self._impl.pwrite(addr, nbytes, path, offset, False, fsync)
        self._growing += growth
        self._held.append(tensor)

    def write_atomic(self, tensor: torch.Tensor, path: str | os.PathLike) -> None:
        """Queue a write of ``tensor`` as the whole new content of ``path``: written to
        ``path + ".partial"``, then fsynced and renamed over ``path`` when it all
        succeeded; removed, leaving ``path`` untouched, when it did not."""
        addr, nbytes = _memory(tensor)
        path = os.fspath(path)
        if self.check_space:
            check_free_space(path, self._growing + nbytes)
        self._impl.pwrite(addr, nbytes, path, 0, True, True)
        self._growing += nbytes
        self._held.append(tensor)

    # completion -------------------------------------------------------------

    def wait(self) -> int:
        """Block until every queued request is done; return how many finished.
        Raises OSError (or EOFError for a short read) naming the file, offset and
        cause if any failed; the others still completed."""
        try:
            return self._impl.wait()
        finally:
            self._release()

    def poll(self) -> int:
        """How many requests are still in flight (0: ``wait()`` will not block)."""
        return self._impl.poll()

    def _release(self) -> None:
        if self._impl.broken():
            _graveyard.extend(self._held)  # the kernel may still write into these
        self._held.clear()
        self._growing = 0

    def inject_error(self, err: int, after_bytes: int = 0) -> None:
        """The fault-injection entry point (tests, and ``zfunc.swap.Faults``):
        the next request fails with ``err`` for every block that goes past its first
        ``after_bytes`` bytes, in every back end."""
        self._impl._inject_error(err, after_bytes)

    def close(self) -> None:
        """Wait for what is in flight (raising its errors) and release the threads."""
        impl = getattr(self, "_impl", None)
        if impl is None:
            return
        try:
            self.wait()
        finally:
            if isinstance(impl, PythonHandle):
                impl.close()
            self._impl = None

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_impl", None) is not None:
            try:
                self.close()
            except Exception as e:  # nobody waited for this error: say so once
                warnings.warn(f"AsyncIO dropped with a failed request: {e}", RuntimeWarning)


def write_file_atomic(path: str | os.PathLike, tensor: torch.Tensor, *, backend: str = "auto",
                      block_size: int = 1 << 20, queue_depth: int = 8) -> None:
    """Write ``tensor`` as the whole content of ``path`` so that ``path`` either holds
    all of it (fsynced) or is left as it was. Blocks until done."""
    with AsyncIO(block_size=block_size, queue_depth=queue_depth, backend=backend) as aio:
        aio.write_atomic(tensor, path)
