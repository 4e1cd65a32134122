"""Host buffers a state's parts wait in while they are off the device, kept and reused.

Each offload to host memory takes one buffer per device storage it moves, and its reload gives it
back; the next cycle takes the same sizes again, so a loop that offloads and reloads every
iteration holds the same host memory after a hundred cycles as after one (pinned memory is slow
to allocate and the OS gives it back slowly: verl's users see host memory grow every cycle where
it is allocated afresh). On CUDA the buffers are page-locked, so the copies run at full speed
and may be asynchronous; a buffer a non-blocking copy still reads is taken again only once that
copy is done (its event).
"""
from __future__ import annotations

import torch


class HostBuffers:
    """Byte buffers on the host, kept by (size, pinned) once given back."""

    def __init__(self):
        self._free: dict[tuple[int, bool], list[tuple[torch.Tensor, object]]] = {}

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A ``uint8`` host tensor of ``nbytes``: a kept one of that size if any, else a new one
        (page-locked if ``pin``, which needs CUDA)."""
        free = self._free.get((nbytes, pin))
        if free:
            buf, done = free.pop()
            if done is not None:
                done.synchronize()  # a non-blocking copy out of it must finish before it is written
            return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give(self, buf: torch.Tensor, done=None) -> None:
        """Keep ``buf`` for the next ``take`` of its size; ``done``: an event that completes once the
        copies still reading it are over (None: none are)."""
        self._free.setdefault((buf.numel(), buf.is_pinned()), []).append((buf, done))

    def held_bytes(self) -> int:
        """Bytes of the buffers kept now."""
        return sum(b.numel() for free in self._free.values() for b, _ in free)

    def clear(self) -> None:
        """Give every kept buffer back to the OS."""
        self._free.clear()


host_buffers = HostBuffers()  # one per process: the sizes repeat from cycle to cycle
