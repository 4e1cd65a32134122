"""Grad sinks: where each unit's gradient goes the moment its backward is done.

Autograd would leave a unit's gradient for ``torch.autograd.grad`` to return; a step that
sums micro-batches (zfunc.transforms.accumulate, the engines) or sends gradients off the device
(zfunc.transforms.offload.cpu, zfunc.transforms.offload.nvme) gives the step's ``Tracker`` a sink instead
(``tracker.sink``, zfunc.materialize), which calls

* ``takes_parts(unit)``: whether the sink takes the unit's per-parameter gradients
  (``take_parts(unit, grads)``, no flat buffer between) rather than
  * ``take(unit, grad_full)``: the unit's full flat gradient, which the sink now owns.

The sink then hands the step its gradients in their home form (``GradSink.grads``,
``GradOffHome.finish``).
"""
from __future__ import annotations

import abc
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import buffers, dist, layout, swap
from ..ops import cpu_adam
from ..placement import CPU
from ..tree import Params


class Sink(abc.ABC):
    """The protocol above: a sink takes flat gradients, and per-parameter ones if it says so."""

    def takes_parts(self, unit) -> bool:
        return False

    def take_parts(self, unit, grads) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes flat gradients only")

    @abc.abstractmethod
    def take(self, unit, grad_full: torch.Tensor) -> None:
        """Take unit ``unit``'s full local gradient (the caller gives it up)."""


class GradSink(Sink):
    """fp32 accumulators, one per unit in its gradient's home form, filled in backward.

    Under ``offload_nvme`` (the parameters' spec names a swap store with gradient
    files) an accumulator lives in its unit's fp32 gradient file between
    micro-batches: read, added to and written back, so RAM holds only the units
    in flight; its norm and inf/NaN check are taken at each write (the last one
    counts), as ``GradToDisk`` does.

    A unit whose placement says ``acc_home`` CPU (``offload_cpu(accumulate_on="host")``) and
    whose gradient is reduce-scattered each micro-batch keeps its sum in pinned host memory:
    each micro-batch's reduced shard is copied down without blocking and added there by a worker
    thread once the copy has landed, so the device holds no accumulator (DeepSpeed's
    ZeRO-Offload accumulates on the host the same way). ``grads()`` waits for the adds.
    """

    def __init__(self, spec):
        self.spec = spec  # the gradients' ParamsSpec (which leaves are shards)
        self.acc: dict[int, torch.Tensor] = {}
        self.last = False  # the last micro-batch: whole gradients are reduced now
        store = swap.store_of(spec.swap)
        self.store = store if store is not None and store.grads else None
        self.on_file: set[int] = set()  # units whose sum so far is in their gradient file
        self.views: dict[int, list] = {}  # unit -> its accumulator's per-parameter views (take_parts)
        self.reducing: dict[int, object] = {}  # unit -> its whole sum's reduction in flight (last micro-batch)
        self.uses_left: dict[int, int] = {}  # unit -> its uses still to come in the last micro-batch
        self.copied = False  # some sum left the device for the host (grads() waits for the copies)
        self._adder = None  # the worker adding micro-batches into host sums (acc_home CPU)
        self._adds: list = []  # its adds in flight

    def _acc(self, unit) -> torch.Tensor:
        acc = self.acc.get(unit.index)
        if acc is None:
            padded = self.spec.segment(unit.index).padded
            w = dist.world_size(unit.group)
            n = layout.home_numel(padded, w, self.spec.sharded[unit.index])
            if self._on_host(unit):
                acc = torch.zeros(n, dtype=torch.float32, device="cpu", pin_memory=torch.cuda.is_available())
            else:
                acc = torch.zeros(n, dtype=torch.float32, device=unit.device)
            if unit.index in self.on_file:
                self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
                self.store.read_now(acc, self.store.file_of(self.store.grads[unit.index]))
            self.acc[unit.index] = acc
        return acc

    def _done(self, unit, acc: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part is in ``acc``: on disk, write it out and let it go. In the last
        micro-batch, a sum whose home is the host (offload_cpu) leaves the device once its unit's
        last use is reduced, so the copies overlap the rest of backward, not the update."""
        if self.store is not None:
            self.store.write_gradient(acc, self.store.grads[unit.index], cpu_adam.nonfinite_and_sq_norm([acc]))
            self.on_file.add(unit.index)
            self.acc.pop(unit.index, None)
        elif self.last and unit.place.grad_home == CPU and unit.place.acc_home != CPU and _on_device(acc):
            left = self.uses_left.get(unit.index, unit.uses) - 1
            self.uses_left[unit.index] = left
            if left == 0:
                self.acc[unit.index] = host = to_host(acc, pin=True)
                self.views.pop(unit.index, None)
                self.copied = True
                return host
        return acc

    def takes_parts(self, unit) -> bool:
        """Whether ``take_parts`` serves ``unit``: a whole gradient summed in RAM."""
        return self.store is None and not self.spec.sharded[unit.index]

    def take_parts(self, unit, grads) -> None:
        """Add a unit's per-parameter gradients (``None``: no gradient) straight into its
        accumulator: the first micro-batch copies, later ones add, as autograd's ``.grad`` does,
        with no flat buffer between."""
        views = self.views.get(unit.index)
        fresh = views is None
        if fresh:
            acc = self.acc[unit.index] = buffers.empty(self.spec.segment(unit.index).padded, torch.float32,
                                                       unit.device)
            views = self.views[unit.index] = list(unit.segment.unflatten(acc).values())
            acc[unit.segment.numel:].zero_()  # the padding
        else:
            acc = self.acc[unit.index]
            self._settled(unit)
        dst, src = [], []
        for view, g in zip(views, grads):
            if g is not None:
                dst.append(view)
                src.append(g)
            elif fresh:
                view.zero_()
        if dst:
            (torch._foreach_copy_ if fresh else torch._foreach_add_)(dst, src)
        self._reduce_if_last(unit, acc)

    def take(self, unit, grad_full: torch.Tensor) -> None:
        """Add a unit's full local gradient (which the caller gives up) into its accumulator."""
        acc = self._acc(unit)
        tracker = unit.tracker
        if self.spec.sharded[unit.index]:
            pending = unit.send_home_start(grad_full)
            add = self._add_on_host if self._on_host(unit) else torch.Tensor.add_
            tracker.reducing(pending.then(lambda g: self._done(unit, add(acc, g)), acc))
            return
        self._settled(unit)
        acc.add_(grad_full)
        buffers.give(grad_full)
        self._reduce_if_last(unit, acc)

    def _on_host(self, unit) -> bool:
        """Whether ``unit``'s sum lives in host memory: ``acc_home`` CPU, reduced every micro-batch."""
        return unit.place.acc_home == CPU and self.spec.sharded[unit.index] and self.store is None

    def _add_on_host(self, acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Add the reduced shard ``g`` into the host sum ``acc``: at once where ``g`` is in host memory;
        else copied down without blocking and added by the worker once the copy has landed (adds
        to one sum run in the order their micro-batches came)."""
        if not _on_device(g):
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

    def take_home(self, index: int, grad: torch.Tensor) -> None:
        """Add unit ``index``'s gradient, already in its home form (zf.jit's program reduced it),
        into its accumulator."""
        acc = self.acc.get(index)
        if acc is None:
            self.acc[index] = grad.float() if grad.dtype != torch.float32 else grad.clone()
        else:
            acc.add_(grad)

    def _settled(self, unit) -> None:
        """A unit used twice in the last micro-batch: its first reduction is over before more is added."""
        pending = self.reducing.pop(unit.index, None)
        if pending is not None:
            pending.wait()

    def _reduce_if_last(self, unit, acc: torch.Tensor) -> None:
        """In the last micro-batch, start reducing a whole sum over the group (once per use; a
        later use waits for it, adds, and reduces its part: the mean is linear)."""
        tracker = unit.tracker
        if self.last:
            pending = unit.send_home_start(acc, out_dtype=acc.dtype)
            if pending.out is not acc:  # reduced in another dtype, or W = 1 made a copy
                pending = pending.then(acc.copy_, acc)
            pending = pending.then(lambda a: self._done(unit, a), acc)
            self.reducing[unit.index] = pending
            tracker.reducing(pending)
        else:
            self._done(unit, acc)

    def grads(self) -> Params:
        """The accumulated gradients; ``None`` for a unit no micro-batch used."""
        adds, self._adds = self._adds, []
        for add in adds:  # the host sums are complete (raising what an add raised)
            add.result()
        if self._adder is not None:
            self._adder.shutdown()
            self._adder = None
        if self.store is None:
            if self.copied and torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the sums sent home in backward have landed
            return Params(self.spec, [self.acc.get(i) for i in range(len(self.spec.sharded))])
        self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
        return Params(self.spec, [self.store.grads[i] if i in self.on_file else None
                                  for i in range(len(self.spec.sharded))])


def _add_landed(acc: torch.Tensor, staged: torch.Tensor, landed) -> None:
    if landed is not None:
        landed.synchronize()
    acc.add_(staged)


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives off the CPU (a seam: tests stand CPU tensors in for device ones)."""
    return t.device.type != "cpu"


def to_host(t, pin: bool):
    """``t`` in CPU memory (pinned if ``pin``, copied without blocking: the caller waits before
    reading): ``t`` itself if it is already there."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    return out.copy_(t, non_blocking=pin)


class GradOffHome(Sink):
    """A grad sink that sends each unit's gradient home the moment autograd
    is done with the unit and hands the reduced gradient to ``_store`` (a host copy, a swap
    file). A unit used more than once in forward has its gradients added first, as autograd would."""

    def __init__(self, spec):
        self.spec = spec  # the gradients' ParamsSpec
        self.left: dict[int, int] = {}  # unit -> backward calls still to come
        self.partial: dict[int, torch.Tensor] = {}  # a unit used more than once: its gradient so far

    def take(self, unit, grad_full: torch.Tensor) -> None:
        i = unit.index
        left = self.left.get(i, unit.uses) - 1
        self.left[i] = left
        if left > 0 or i in self.partial:
            if i in self.partial:
                self.partial[i].add_(grad_full)
            else:
                self.partial[i] = grad_full
            if left > 0:
                return
            grad_full = self.partial.pop(i)
        pending = unit.send_home_start(grad_full, out_dtype=unit.anchor.dtype)
        unit.tracker.reducing(pending.then(lambda g: self._store(unit, g), pending.out))

    @abc.abstractmethod
    def _store(self, unit, g: torch.Tensor) -> None:
        """Take unit ``unit``'s reduced gradient ``g`` home."""


class AccumulatingGrad:
    """A grad function that hands every micro-batch its own ``GradSink`` (what ``accumulate``
    wraps the gradient with), so an offload transform inside it must not give it another
    one: ``with_grad_sink`` leaves it as it is. A type, so the protocol is stated, not an
    attribute set on a closure."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, params, batch, **kw):
        return self.fn(params, batch, **kw)


def with_grad_sink(grad_fn, make_sink):
    """``grad_fn`` handing each unit's gradient to ``make_sink(params)`` (a ``GradOffHome``; None:
    autograd's own way), whose ``finish()`` gives the step its gradients. Under ``accumulate``
    its own sink is used instead: inside, it hands one per micro-batch (an ``AccumulatingGrad``);
    outside, it passes one in."""
    if isinstance(grad_fn, AccumulatingGrad):
        return grad_fn

    def run(params, batch, *, sink=None, **kw):
        if sink is None:
            sink = make_sink(params)
            if sink is not None:
                out = grad_fn(params, batch, sink=sink, **kw)
                return out._replace(grads=sink.finish())
        return grad_fn(params, batch, sink=sink, **kw)

    return run
