"""Gradient accumulation as a step transform: ``n`` micro-batches, one update.

``accumulate(step, n)`` makes the step take a sequence (or iterator) of ``n``
micro-batches. Each micro-batch's backward hands every unit's gradient to a
``GradSink`` (zfunc.transforms.sinks) instead of to autograd, which adds it into an fp32 accumulator
in the gradient's home form (kept where an offload transform says, either side of it):

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

from ..grad import GradOut, grad_spec, merge_live
from .sinks import AccumulatingGrad, GradSink, OffloadedGrad
from ..step import Step, expect_step
from ..transform import Transform, check_inside_zero


class Accumulate(Transform):
    family = "accumulate"
    shapes_state = False
    accumulates = True

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
        inside = grad_fn.sums if isinstance(grad_fn, OffloadedGrad) else None  # an offload inside: its sums' home

        def run(params, batch, sums, **kw):
            micro = self.micro_batches(batch)
            sink = GradSink(grad_spec(params.spec), sums)
            losses, auxes, peak, prefetch, live = [], [], 0, (), {}
            for i, mb in enumerate(micro):
                sink.last = i == len(micro) - 1
                out = grad_fn(params, mb, sink=sink, **kw)
                losses.append(out.loss)
                auxes.append(out.aux)
                peak = max(peak, out.peak)
                prefetch += out.prefetch
                live = merge_live(live, out.live)  # a parameter some micro-batch read has a gradient
            return GradOut(torch.stack(losses).mean(), auxes, sink.grads(), peak, out.grad_scale / self.n, prefetch,
                           live)

        return AccumulatingGrad(run, inside)  # it hands every micro-batch its own sink


def accumulate(step: Step, n: int) -> Step:
    """Accumulate gradients over ``n`` micro-batches per step (module docstring).

    The step's ``batch`` is then a sequence or iterator of ``n`` micro-batches
    (each what ``loss_fn`` takes); ``metrics["aux"]`` is the list of their aux
    values. Write it inside the ZeRO stage: ``zero3(accumulate(f, n))``.
    """
    expect_step(step, "accumulate")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"accumulate: n must be an int >= 1, got {n!r}")
    return step.then(Accumulate(n))
