"""Grad sinks: where each unit's gradient goes the moment its backward is done.

Autograd would leave a unit's gradient for ``torch.autograd.grad`` to return; a step that
sums micro-batches (zfunc.transforms.accumulate, the engines) or sends gradients off the device
(zfunc.transforms.offload.cpu, zfunc.transforms.offload.nvme) gives the step's ``Tracker`` a sink instead
(``tracker.sink``, zfunc.materialize), which calls

* ``takes_parts(unit)``: whether the sink takes the unit's per-parameter gradients
  (``take_parts(unit, grads)``, no flat buffer between) rather than
  * ``take(unit, grad_full)``: the unit's full flat gradient, which the sink now owns.

The sink then hands the step its gradients in their home form (``GradSink.grads``,
``GradOffHome.finish``). Where gradients go off the device is the offload transforms' to say:
each gives its ``GradOffHome`` a ``_store``, and a ``GradSink`` the home of its sums
(``SumHome``), so nothing here names a tier.
"""
from __future__ import annotations

import abc

import torch

from .. import buffers, dist, layout, placement
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


class SumHome:
    """Where an accumulating step's fp32 sums live between micro-batches, and how they are added to.

    This one keeps each unit's sum in the sink, in memory on the unit's device. An offload
    transform that keeps gradients elsewhere hands the sink its own home, one per step
    (``Transform.sum_home``; under ``accumulate``, through ``with_grad_sink``), so the sink never
    names a tier: zfunc.transforms.offload's homes keep sums in host memory or in the gradient
    files."""

    in_memory = True  # sums stay in the sink between micro-batches, so per-parameter gradients may go straight in

    def start(self, unit, numel: int) -> torch.Tensor:
        """``unit``'s sum to add this micro-batch into, ``numel`` fp32 elements, where the sink holds
        none: zeros, or (for a home that keeps it elsewhere) the sum so far."""
        return torch.zeros(numel, dtype=torch.float32, device=unit.device)

    def add(self, unit, acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Add ``unit``'s shard ``g``, reduced this micro-batch, into its sum ``acc``."""
        return acc.add_(g)

    def done(self, unit, acc: torch.Tensor, last: bool) -> torch.Tensor | None:
        """This micro-batch's part of ``unit`` is in ``acc`` (``last``: in the last micro-batch): the sum
        the sink holds from now on (``acc``, or a copy of it elsewhere), or None where the home took
        it and the sink holds nothing."""
        return acc

    def grads(self, sums: dict[int, torch.Tensor], n: int) -> list:
        """The step's gradients of ``n`` units once every micro-batch is in: each unit's sum (``sums``:
        those the sink holds), None for a unit no micro-batch used."""
        return [sums.get(i) for i in range(n)]


class GradSink(Sink):
    """fp32 accumulators, one per unit in its gradient's home form, filled in backward.

    ``sums(spec)`` gives the ``SumHome`` of this step's sums (None, or no ``sums``: the sink's own
    memory on the device): where each unit's sum lives between micro-batches and how a reduced
    shard is added to it. The offload transforms hand theirs (``Transform.sum_home``). Whole
    gradients (stage 0, zero1) are added up in memory and reduced once, in the last micro-batch.
    """

    def __init__(self, spec, sums=None):
        self.spec = spec  # the gradients' ParamsSpec (which leaves are shards)
        home = None if sums is None else sums(spec)
        self.home = SumHome() if home is None else home
        self.acc: dict[int, torch.Tensor] = {}  # unit -> its sum, where the sink holds it
        self.last = False  # the last micro-batch: whole gradients are reduced now
        self.views: dict[int, list] = {}  # unit -> its accumulator's per-parameter views (take_parts)
        self.reducing: dict[int, object] = {}  # unit -> its whole sum's reduction in flight (last micro-batch)

    def _acc(self, unit) -> torch.Tensor:
        acc = self.acc.get(unit.index)
        if acc is None:
            padded = self.spec.segment(unit.index).padded
            w = dist.world_size(unit.group)
            n = layout.home_numel(padded, w, self.spec.sharded[unit.index])
            acc = self.acc[unit.index] = self.home.start(unit, n)
        return acc

    def _done(self, unit, acc: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part is in ``acc``: its home takes it (``SumHome.done``); the sink
        holds what the home hands back."""
        kept = self.home.done(unit, acc, self.last)
        if kept is None:
            self.acc.pop(unit.index, None)
            return acc
        if kept is not acc:
            self.acc[unit.index] = kept
            self.views.pop(unit.index, None)
        return kept

    def takes_parts(self, unit) -> bool:
        """Whether ``take_parts`` serves ``unit``: a whole gradient summed in the sink's memory."""
        return self.home.in_memory and not self.spec.sharded[unit.index]

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
            pos = 0
            for e in unit.segment.entries:  # the gaps of an owner layout (zfunc.tree._segment)
                acc[pos : e.offset].zero_()
                pos = e.offset + e.numel
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
            pending = unit.send_home_start(grad_full, final=False)
            added = lambda g: self._done(unit, self._replicated(unit, self.home.add(unit, acc, g)))  # noqa: E731
            tracker.reducing(pending.then(added, acc))
            return
        self._settled(unit)
        acc.add_(grad_full)
        buffers.give(grad_full)
        self._reduce_if_last(unit, acc)

    def _replicated(self, unit, acc: torch.Tensor) -> torch.Tensor:
        """Hybrid sharding: in the last micro-batch, once its shard is added, the sum averaged over
        the replicas (``placement.replicate_mean``): one all-reduce a step, of the whole sum."""
        return placement.replicate_mean(unit.place, acc) if self.last else acc

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
        return Params(self.spec, self.home.grads(self.acc, len(self.spec.sharded)))


class GradOffHome(Sink):
    """A grad sink that sends each unit's gradient home the moment autograd
    is done with the unit and hands the reduced gradient to ``_store`` (its offload transform's:
    zfunc.transforms.offload). A unit used more than once in forward has its gradients added
    first, as autograd would."""

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
    wraps the gradient with), so an offload transform outside it must not give it another one:
    ``with_grad_sink`` hands it the home of its sums instead (``homed``). ``fn(params, batch,
    sums, **kw)``: ``sums`` makes the ``SumHome`` of a step (None: device memory). A type, so the
    protocol is stated, not an attribute set on a closure."""

    def __init__(self, fn, sums=None):
        self.fn, self.sums = fn, sums

    def __call__(self, params, batch, **kw):
        return self.fn(params, batch, self.sums, **kw)

    def homed(self, sums) -> "AccumulatingGrad":
        """This grad function with its sums kept where ``sums`` says."""
        return AccumulatingGrad(self.fn, sums)


class OffloadedGrad:
    """A grad function an offload transform wrapped (``with_grad_sink``): ``accumulate`` outside
    it keeps its sums where ``sums`` says (``sums(spec)``: a ``SumHome``, or None)."""

    def __init__(self, fn, sums):
        self.fn, self.sums = fn, sums

    def __call__(self, params, batch, **kw):
        return self.fn(params, batch, **kw)


def with_grad_sink(grad_fn, make_sink, sums):
    """``grad_fn`` handing each unit's gradient to ``make_sink(params)`` (a ``GradOffHome``; None:
    autograd's own way), whose ``finish()`` gives the step its gradients. Under ``accumulate``
    its own sink is used instead, with its sums where ``sums`` says: inside, accumulate hands
    one per micro-batch (an ``AccumulatingGrad``, given ``sums``); outside, it passes one in (and
    reads ``sums`` off the ``OffloadedGrad``)."""
    if isinstance(grad_fn, AccumulatingGrad):
        return grad_fn.homed(sums)

    def run(params, batch, *, sink=None, **kw):
        if sink is None:
            sink = make_sink(params)
            if sink is not None:
                out = grad_fn(params, batch, sink=sink, **kw)
                return out._replace(grads=sink.finish())
        return grad_fn(params, batch, sink=sink, **kw)

    return OffloadedGrad(run, sums)
