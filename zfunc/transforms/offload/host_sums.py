"""offload_cpu's home for accumulated sums, and its copies to host memory (``to_host``).

Under ``accumulate`` (or the engines' micro-batches) a unit whose update runs on the host wants its
fp32 sum there at the end of the step. ``HostSums``, the ``SumHome`` offload_cpu hands the
step's ``GradSink`` (zfunc.transforms.sinks), gets it there one of two ways:

* ``accumulate_on="host"`` (``acc_home`` CPU), for a unit whose gradient is reduce-scattered each
  micro-batch: its sum lives in pinned host memory; each micro-batch's reduced shard is copied
  down without blocking and added there by a worker thread once the copy has landed, so the
  device holds no accumulator (DeepSpeed's ZeRO-Offload accumulates on the host the same way);
* else its sum stays on the device and leaves for the host in the last micro-batch's backward,
  once the unit's last use is reduced, so the copies overlap the rest of backward, not the update.

Units offload_cpu keeps on the device sum there, as ``SumHome`` does.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ...placement import CPU
from ..sinks import SumHome


def to_host(t, pin: bool):
    """``t`` in CPU memory (pinned if ``pin``, copied without blocking: the caller waits before
    reading): ``t`` itself if it is already there."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    return out.copy_(t, non_blocking=pin)


class SideCopies:
    """Copies of device tensors into pinned host memory on a side stream (CUDA only).

    A non-blocking copy queued on the compute stream still holds back every kernel queued after it;
    on a stream of its own (which first waits for what the compute stream has queued) it overlaps
    the rest of backward (DeepSpeed #8207 measured backward 18-28% faster for that alone). The
    source is marked used by the side stream, so its memory is not reused before the copy has read
    it. ``wait()``: every copy has landed."""

    def __init__(self):
        self._stream = None
        self._queued = False

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(self._stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self._stream)
        self._queued = True
        return out

    def wait(self) -> None:
        if self._queued:
            self._stream.synchronize()
            self._queued = False


def side_copies(pin: bool) -> SideCopies | None:
    """A ``SideCopies`` where copies can run beside compute (pinned memory, CUDA), else None."""
    return SideCopies() if pin and torch.cuda.is_available() else None


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives off the CPU (a seam: tests stand CPU tensors in for device ones)."""
    return t.device.type != "cpu"


def _add_landed(acc: torch.Tensor, staged: torch.Tensor, landed) -> None:
    if landed is not None:
        landed.synchronize()
    acc.add_(staged)


class HostSums(SumHome):
    """One step's sums under offload_cpu (module docstring); ``spec``: the gradients' ParamsSpec.
    ``grads()`` waits for the worker's adds and for the sums sent home."""

    def __init__(self, spec):
        self.spec = spec
        self.uses_left: dict[int, int] = {}  # unit -> its uses still to come in the last micro-batch
        self.copied = False  # some sum left the device for the host (grads() waits for the copies)
        self._adder = None  # the worker adding micro-batches into host sums (acc_home CPU)
        self._adds: list = []  # its adds in flight
        self._side = side_copies(pin=True)  # the sums sent home in the last backward

    def _on_host(self, unit) -> bool:
        """Whether ``unit``'s sum lives in host memory: ``acc_home`` CPU, reduced every micro-batch."""
        return unit.place.acc_home == CPU and self.spec.sharded[unit.index]

    def start(self, unit, numel: int) -> torch.Tensor:
        if self._on_host(unit):
            return torch.zeros(numel, dtype=torch.float32, device="cpu", pin_memory=torch.cuda.is_available())
        return super().start(unit, numel)

    def add(self, unit, acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Into a host sum: at once where ``g`` is in host memory; else copied down without blocking
        and added by the worker once the copy has landed (adds to one sum run in the order their
        micro-batches came)."""
        if not self._on_host(unit) or not _on_device(g):
            return acc.add_(g)
        staged = to_host(g, pin=True)
        landed = None
        if staged.is_pinned() and torch.cuda.is_available():
            landed = torch.cuda.Event()
            landed.record()
        if self._adder is None:
            self._adder = ThreadPoolExecutor(1, thread_name_prefix="zfunc-host-sums")
        self._adds.append(self._adder.submit(_add_landed, acc, staged, landed))
        return acc

    def done(self, unit, acc: torch.Tensor, last: bool) -> torch.Tensor:
        """In the last micro-batch, a device sum whose home is the host leaves once its unit's last
        use is reduced: its host copy is the sum from then on."""
        place = unit.place
        if last and place.grad_home == CPU and place.acc_home != CPU and _on_device(acc):
            left = self.uses_left.get(unit.index, unit.uses) - 1
            self.uses_left[unit.index] = left
            if left == 0:
                self.copied = True
                return self._side.copy(acc) if self._side is not None else to_host(acc, pin=True)
        return acc

    def grads(self, sums: dict[int, torch.Tensor], n: int) -> list:
        adds, self._adds = self._adds, []
        for add in adds:  # the host sums are complete (raising what an add raised)
            add.result()
        if self._adder is not None:
            self._adder.shutdown()
            self._adder = None
        if self.copied and self._side is not None:
            self._side.wait()  # the sums sent home in backward have landed
        return super().grads(sums, n)
