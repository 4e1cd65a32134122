"""Gradient accumulation as a step transform: ``n`` micro-batches, one update.

``accumulate(step, n)`` makes the step take a sequence (or iterator) of ``n``
micro-batches. Each micro-batch's backward hands every unit's gradient to a
``GradSink`` instead of to autograd, which adds it into an fp32 accumulator
in the gradient's home form:

* gradients that go home as shards (zero2, zero3) are reduce-scattered each
  micro-batch and added into a sharded accumulator, so no full-size gradient
  outlives its unit's backward;
* gradients that go home whole (stage 0, zero1) are added up locally and
  all-reduced once, in the last micro-batch's backward (DDP's ``no_sync``):
  a 1/n of the communication.

The update then sees the accumulated sum, with ``1/n`` folded into the scale
the optimizer applies, so the result equals one step on the concatenation of
the micro-batches. The loss metric is the mean over micro-batches and ranks.
"""
from __future__ import annotations

from itertools import islice

import torch

from . import buffers, dist, layout, swap
from .ops import cpu_adam
from .grad import GradOut, grad_spec
from .step import Step
from .transform import Transform, check_inside_zero
from .tree import Params


class GradSink:
    """fp32 accumulators, one per unit in its gradient's home form, filled in backward.

    Under ``offload_nvme`` (the parameters' spec names a swap store with gradient
    files) an accumulator lives in its unit's fp32 gradient file between
    micro-batches: read, added to and written back, so RAM holds only the units
    in flight; its norm and inf/NaN check are taken at each write (the last one
    counts), as ``GradToDisk`` does.
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

    def _acc(self, unit) -> torch.Tensor:
        acc = self.acc.get(unit.index)
        if acc is None:
            padded = self.spec.segment(unit.index).padded
            w = dist.world_size(unit.group)
            n = layout.home_numel(padded, w, self.spec.sharded[unit.index])
            acc = torch.zeros(n, dtype=torch.float32, device=unit.device)
            if unit.index in self.on_file:
                self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
                self.store.read_now(acc, self.store.file_of(self.store.grads[unit.index]))
            self.acc[unit.index] = acc
        return acc

    def _done(self, unit, acc: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part is in ``acc``: on disk, write it out and let it go."""
        if self.store is not None:
            self.store.write_gradient(acc, self.store.grads[unit.index], cpu_adam.nonfinite_and_sq_norm([acc]))
            self.on_file.add(unit.index)
            self.acc.pop(unit.index, None)
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
            tracker.reducing(pending.then(lambda g: self._done(unit, acc.add_(g)), acc))
            return
        self._settled(unit)
        acc.add_(grad_full)
        buffers.give(grad_full)
        self._reduce_if_last(unit, acc)

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
        if self.store is None:
            return Params(self.spec, [self.acc.get(i) for i in range(len(self.spec.sharded))])
        self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
        return Params(self.spec, [self.store.grads[i] if i in self.on_file else None
                                  for i in range(len(self.spec.sharded))])


class Accumulate(Transform):
    family = "accumulate"
    shapes_state = False

    def __init__(self, n: int):
        self.n = n

    def describe(self, inner: str) -> str:
        return f"accumulate({inner}, {self.n})"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, f"zeroN(accumulate(f, {self.n}))")

    def micro_batches(self, batch) -> list:
        """The ``n`` micro-batches of ``batch`` (a sequence or an iterator of exactly ``n``)."""
        if isinstance(batch, torch.Tensor) or not hasattr(batch, "__iter__"):
            raise TypeError(f"accumulate(step, {self.n}) takes a sequence of {self.n} micro-batches, "
                            f"got a {type(batch).__name__}")
        if hasattr(batch, "__len__"):
            if len(batch) != self.n:
                raise ValueError(f"accumulate(step, {self.n}) got {len(batch)} micro-batches; pass exactly {self.n}")
            return list(batch)
        micro = list(islice(batch, self.n))
        if len(micro) != self.n:
            raise ValueError(f"accumulate(step, {self.n}): the iterator gave only {len(micro)} micro-batches")
        return micro

    def wrap_grad(self, grad_fn):
        def run(params, batch, **kw):
            micro = self.micro_batches(batch)
            sink = GradSink(grad_spec(params.spec))
            losses, auxes, peak, prefetch = [], [], 0, ()
            for i, mb in enumerate(micro):
                sink.last = i == len(micro) - 1
                out = grad_fn(params, mb, sink=sink, **kw)
                losses.append(out.loss)
                auxes.append(out.aux)
                peak = max(peak, out.peak)
                prefetch += out.prefetch
            return GradOut(torch.stack(losses).mean(), auxes, sink.grads(), peak, out.grad_scale / self.n, prefetch)

        run.accumulates = True  # it hands every micro-batch its own sink (zfunc.offload_nvme looks)
        return run


def accumulate(step: Step, n: int) -> Step:
    """Accumulate gradients over ``n`` micro-batches per step (module docstring).

    The step's ``batch`` is then a sequence or iterator of ``n`` micro-batches
    (each what ``loss_fn`` takes); ``metrics["aux"]`` is the list of their aux
    values. Write it inside the ZeRO stage: ``zero3(accumulate(f, n))``.
    """
    if not isinstance(step, Step):
        raise TypeError(f"accumulate transforms a zfunc Step (zf.train_step or zf.eval_step), got {type(step).__name__}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"accumulate: n must be an int >= 1, got {n!r}")
    return step.then(Accumulate(n))
