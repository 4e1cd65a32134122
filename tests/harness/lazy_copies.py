"""The CUDA path's copies played on the CPU: ``LazyCopies`` stands in for the device (uploads and
downloads that land late, checked for a buffer reused under a copy in flight), and ``lazy_copies_run``
runs ``cases.run_composed`` with every offload_nvme store copying through it (on each rank)."""
import torch

import zfunc as zf
from cases import run_composed


class LazyCopies(zf.swap.Device):
    """The GPU's copies with CPU tensors: an upload's source must stay unchanged until an event
    recorded after it is waited for (else a pinned buffer was reused under a copy in flight), and
    a download lands only then (until then its destination holds NaN, so a read too early shows)."""

    counts = {"upload": 0, "download": 0, "sync": 0}

    def __init__(self, device):
        super().__init__(device)
        self.copies = True
        self.queue = []  # (serial, kind, dst, src as it was when queued, src)
        self.serial = 0

    def _land(self, upto: float) -> None:
        """Copies queued before ``upto`` are done now; every later upload's source still unchanged."""
        for n, kind, dst, was, src in self.queue:
            if kind == "upload":
                assert torch.equal(was, src), "a pinned buffer changed while its upload was in flight"
            elif n < upto:
                dst.copy_(was)
        self.queue = [e for e in self.queue if e[0] >= upto]

    def _queue(self, kind, dst, src):
        self._land(-1)  # nothing lands, but nothing queued may have changed meanwhile
        LazyCopies.counts[kind] += 1
        self.queue.append((self.serial, kind, dst, src.clone(), src))
        self.serial += 1

    def upload(self, dst, src):
        self._queue("upload", dst, src)
        return dst.copy_(src)  # the device's stream runs it before any compute that reads dst

    def download(self, dst, src):
        self._queue("download", dst, src)
        return dst.fill_(float("nan"))

    def event(self):
        mark, device = self.serial, self

        class Event:
            @staticmethod
            def synchronize():
                LazyCopies.counts["sync"] += 1
                device._land(mark)
        return Event


def lazy_copies_run(*args) -> dict:
    """``run_composed`` with every offload_nvme store copying through ``LazyCopies``."""
    saved, zf.swap.device_for = zf.swap.device_for, LazyCopies
    LazyCopies.counts.update(upload=0, download=0, sync=0)
    try:
        out = run_composed(*args)
    finally:
        zf.swap.device_for = saved
    return out | {"copies": dict(LazyCopies.counts)}
