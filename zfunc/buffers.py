"""Large buffers that live for part of a step: a gathered unit, a unit's full gradient, init's flat copies.

Made and dropped every step, interleaved with activations, they must neither
stay resident after use nor be faulted in afresh each time. ``use_large_blocks``
(called by ``Step.init``) makes torch's CPU allocator zfunc's large-block
cache (zfunc.ops.large_blocks): every CPU tensor of 1 MiB or more, ours and
autograd's alike, is then reused by size and bounded by the peak of live
blocks, and the functions here are plain ``torch.empty``. Where that op
cannot be built (or ``ZFUNC_CPU_ALLOCATOR=0``), two fallbacks cover our own
buffers, though not autograd's:

* ``take``/``give``: a freed CPU buffer whose storage nobody else holds goes
  to a pool keyed by size (at most ``PER_SIZE`` each) and the next gather of
  that size reuses it;
* ``empty``: a new CPU buffer of at least ``MIN_BYTES`` is its own mapping
  (transparent huge pages where offered), so one dropped for good, such as
  init's flat copies, is given back to the OS at once.
"""
from __future__ import annotations

import mmap

import torch

from .ops import large_blocks

MIN_BYTES = 1 << 20  # below this, malloc's heap is the better place
PER_SIZE = 2  # free buffers kept per (size, dtype): enough for the units in flight
_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)
_pool: dict[tuple, list[torch.UntypedStorage]] = {}


def use_large_blocks() -> bool:
    """Install the large-block CPU allocator if it can be (once per process); True if in use."""
    return large_blocks.install()


def empty(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized 1-D tensor; on CPU and at least ``MIN_BYTES``, in its own mapping."""
    device = torch.device(device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or large_blocks.installed():
        return torch.empty(numel, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes)  # zero-filled by the OS
    if _HUGE is not None:
        mapping.madvise(_HUGE)  # 2 MiB pages: far fewer page faults on first touch
    # the tensor holds the mapping through the buffer protocol; unmapped when it dies
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = empty(numel, dtype, device)
    return t if _mapped(t) else t.zero_()  # a fresh mapping is zero-filled by the OS


def take(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer of ``numel`` elements: a fresh tensor over pooled storage if any, else ``empty``."""
    free = None if large_blocks.installed() else _pool.get((numel, dtype, torch.device(device)))
    if not free:
        return empty(numel, dtype, device)
    return torch.empty(0, dtype=dtype, device=device).set_(free.pop(), 0, (numel,))


def give(t: torch.Tensor) -> None:
    """Offer ``t``'s storage for reuse; kept only if no other tensor shares it.

    The pool keeps storages, never tensor objects: the next user gets a new
    tensor with no autograd history.
    """
    if not _mapped(t) or t.storage_offset() or not t.is_contiguous():
        return  # (the large-block allocator, when installed, already reuses it)
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size():
        return
    if torch._C._storage_Use_Count(storage._cdata) > 2:  # t, and this storage object
        return
    free = _pool.setdefault((t.numel(), t.dtype, t.device), [])
    if len(free) < PER_SIZE and all(f.data_ptr() != storage.data_ptr() for f in free):
        free.append(storage)


def trim() -> None:
    """Give cached and free heap memory back to the OS: the large-block cache, then glibc's
    ``malloc_trim`` (elsewhere a no-op).

    ``offload_nvme``, whose point is a resident size independent of the model,
    trims after each unit of its init. Not per step: memory given back is
    faulted in again by the next step (that cost about 10% of a step here).
    """
    large_blocks.empty_cache()
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def clear() -> None:
    """Drop the pooled buffers (their memory goes back to the OS)."""
    _pool.clear()


def _mapped(t: torch.Tensor) -> bool:
    """Made by ``empty``'s own mapping (not by the large-block allocator)."""
    return t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_BYTES and not large_blocks.installed()
