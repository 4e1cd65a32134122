"""Where compute sees a unit read from disk, and the copies between it and host buffers.

On the CPU compute uses the host buffers themselves. On an accelerator a read lands in a pinned
buffer and is uploaded without blocking; a gradient comes back into a pinned buffer the same way.
The host touches such a buffer again only after the event of its copy: ``Device`` holds the copies
and their events, so the store and the pool (zfunc.swap.store, zfunc.swap.pool) never name CUDA.
"""
from __future__ import annotations

import torch


class Landed:
    """The event of copies that are over when they return (the CPU's)."""

    @staticmethod
    def synchronize() -> None:
        pass


class Device:
    """Where compute sees a unit read from disk, and the copies between it and host buffers.

    On the CPU (gloo) compute uses the host buffers themselves (``copies`` False). On CUDA a
    read lands in a pinned buffer and is ``upload``-ed without blocking; a gradient is
    ``download``-ed into a pinned buffer. Both may still run when the call returns: the host
    reads or reuses a buffer only after ``event().synchronize()`` of an event recorded after
    the copy. Tests set ``device_for`` to a subclass that runs this order with CPU tensors."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.copies = self.device.type != "cpu"

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Queue host ``src`` into device ``dst``."""
        return dst.copy_(src, non_blocking=True)

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Queue device ``src`` into host ``dst``."""
        return dst.copy_(src, non_blocking=True)

    def event(self):
        """Marks the copies queued so far; ``synchronize()`` returns once they are done."""
        if self.device.type != "cuda":
            return Landed
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``src`` (device side) in host ``dst``, landed: the host may read it now."""
        self.download(dst, src)
        self.event().synchronize()
        return dst


def device_for(device: torch.device) -> Device:
    """The ``Device`` of a store whose compute runs on ``device`` (a seam for tests: they set
    ``zfunc.swap.device_for``, which offload_nvme calls)."""
    return Device(device)
