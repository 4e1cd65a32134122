"""The host buffers units are read into: aligned sizes, a transfer's parts, the pool.

Direct I/O (zfunc.ops.aio) reads into and writes from buffers aligned to ``ALIGN`` bytes, of
sizes rounded up to it. A store reads each unit into one of a fixed pool of ``count`` such
buffers (``BufferPool``), so host memory stays the pool whatever the model's size; a transfer
larger than a buffer goes a buffer's worth at a time (``parts``).
"""
from __future__ import annotations

import torch

from ..ops import aio
from .device import Landed

ALIGN = aio.ALIGNMENT


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to whole ``ALIGN`` blocks."""
    return -(-nbytes // ALIGN) * ALIGN


def parts(n: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``size`` that cover ``n`` elements, in order (for
    ``n = 0``, the one empty range)."""
    return [(a, min(a + size, n)) for a in range(0, n, size)] or [(0, 0)]


class BufferPool:
    """``count`` aligned buffers of ``nbytes`` each, made on first use and reused.

    A request when all are taken gets a buffer of its own (counted in
    ``overflow``), dropped when given back, so a step never deadlocks on the pool;
    so does a request larger than ``nbytes`` (a unit larger than a pool buffer).
    """

    def __init__(self, count: int, nbytes: int):
        self.count, self.nbytes = count, aligned(max(nbytes, 1))
        self._free: list[torch.Tensor] = []
        self._ours: dict[int, torch.Tensor] = {}  # storage ptr -> raw pool buffer in use
        self._extra: set[int] = set()  # storage ptrs of overflow and oversize buffers in use
        self._alone: dict[int, int] = {}  # storage ptr -> its reference count when only the pool holds it
        self._landing: dict[int, object] = {}  # storage ptr -> event after the last copy out of it
        self.made = 0
        self.overflow = 0
        self.in_use = 0
        self.peak_in_use = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes > self.nbytes:
            raw = aio.aligned_empty(aligned(nbytes))
            self._extra.add(raw.untyped_storage().data_ptr())
        elif self._free or self.made < self.count:
            if self._free:
                raw = self._free.pop()
                self._landing.pop(raw.untyped_storage().data_ptr(), Landed).synchronize()  # its upload is done
            else:
                raw = aio.aligned_empty(self.nbytes)
                self.made += 1
                storage = raw.untyped_storage()
                # references to the storage when the pool alone holds it (raw, its base, this object)
                self._alone[storage.data_ptr()] = torch._C._storage_Use_Count(storage._cdata)
            self._ours[raw.untyped_storage().data_ptr()] = raw
        else:
            self.overflow += 1
            raw = aio.aligned_empty(aligned(nbytes))
            self._extra.add(raw.untyped_storage().data_ptr())
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return raw[:nbytes].view(dtype)

    def give(self, t: torch.Tensor, after=None) -> bool:
        """Take back a buffer ``take`` handed out; False if it is not one of ours. ``after``: the event
        of a copy out of it that may still run; the buffer is read into again only once it is done."""
        if t.device.type != "cpu":
            return False
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        raw = self._ours.pop(ptr, None)
        if raw is not None:
            # reused only if nothing but t holds it besides the pool; else it is left to its
            # holder and the pool makes another
            if torch._C._storage_Use_Count(storage._cdata) > self._alone[ptr] + 1:
                self.made -= 1
                del self._alone[ptr]
                (after or Landed).synchronize()
            else:
                self._free.append(raw)
                if after is not None:
                    self._landing[ptr] = after
        elif ptr in self._extra:
            self._extra.discard(ptr)
            (after or Landed).synchronize()  # dropped: no copy may still read it
        else:
            return False
        self.in_use -= 1
        return True

    def resident_bytes(self) -> int:
        return self.made * self.nbytes

    def available(self) -> int:
        """Pool buffers not handed out now (made or still to make)."""
        return self.count - len(self._ours)
