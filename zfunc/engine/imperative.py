"""The imperative style's bookkeeping: DeepSpeed's ``out = engine(batch); engine.backward(loss); engine.step()``.

A step in this style (``Window``) spans calls the user makes: each ``engine(batch)`` with
gradients on is a pass (``_Pass``) whose units' materialization stays open, with its graph,
until a backward goes through it (zfunc.grad.materialized); each ``backward`` adds its
gradients to the step's sums (an ``accumulate`` ``GradSink``, zfunc.transforms.sinks), and
closes the passes it reached; the ``step()`` at the accumulation boundary takes the sums as
the step's gradients (``Window.grad_out``) for ``Step.apply_gradients``. The Engine
(zfunc.engine.engine) counts the micro-steps and decides the boundary.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from typing import Callable

import torch

from .. import dist, lazy, swap
from ..grad import GradOut, forward as run_forward, grad_spec, materialized, merge_live
from ..materialize import Materialize
from ..placement import replicate_mean
from ..step import Step
from ..transforms.sinks import GradSink, Sink
from ..tree import Params


class _StepSums(GradSink):
    """The gradient sums of an imperative step (zfunc.transforms.sinks's ``GradSink``), noting which
    passes each backward reached (the trackers of the units whose gradients it took)."""

    def __init__(self, spec, sums=None):
        super().__init__(spec, sums)
        self.reached: set = set()

    def take(self, unit, grad_full: torch.Tensor) -> None:
        self.reached.add(unit.tracker)
        super().take(unit, grad_full)

    def take_parts(self, unit, grads) -> None:
        self.reached.add(unit.tracker)
        super().take_parts(unit, grads)


class _Spent(Sink):
    """The sink of a closed pass: a backward through its output would put gradients nowhere."""

    def takes_parts(self, unit) -> bool:
        raise RuntimeError(
            "backward through the output of an engine(batch) whose pass is over: an earlier engine.backward "
            "went through it, or engine.step() made the update after it. Run engine(batch) again; to "
            "backward twice through one output, pass retain_graph=True to the first engine.backward")

    def take(self, unit, grad_full: torch.Tensor) -> None:
        self.takes_parts(unit)


class _Unfinished(Exception):
    """Closes a pass no backward went through: it did not complete, so its order is not recorded
    as a trace for the coordinator to prefetch along (zfunc.grad.materialized)."""


class _Pass:
    """One ``engine(batch)`` with gradients on: its units' materialization (zfunc.grad.materialized)
    stays open, the graph kept, until a backward has gone through it, the update ends the step,
    or the graph is gone (nothing can backward through it any more)."""

    def __init__(self, context, sums: _StepSums):
        self.context = context
        self.view, self.tracker, _ = context.__enter__()
        self.tracker.sink = sums
        self.alive = 0  # this pass's Materialize nodes still in some graph
        self.orphaned = False
        self.watches: list = []

    def watch(self, out) -> None:
        """Note when the graph from ``out`` to this pass's units is gone (if ``out``'s tensors
        can be found: tensors in tuples, lists and mappings)."""
        for node in _materializations(out, self.tracker):
            self.alive += 1
            self.watches.append(weakref.finalize(node, self._gone))

    def _gone(self) -> None:
        self.alive -= 1
        self.orphaned = self.alive == 0

    def close(self, error: BaseException | None = None) -> None:
        for w in self.watches:
            w.detach()
        # with an error the set-up ends as if it was raised inside (it is not raised again here)
        self.context.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)
        self.tracker.sink = _Spent()


def _materializations(out, tracker) -> list:
    """The ``Materialize`` nodes of ``tracker``'s units that ``out``'s graph reaches: they live as
    long as a graph through that pass does."""
    todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    seen, found = set(), []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is Materialize._backward_cls:
            if node.unit.tracker is tracker:
                found.append(node)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class Window:
    """The imperative style's step in progress: from the first ``engine(batch)`` with gradients
    on to the ``step()`` that updates."""

    def __init__(self, step: Step, state):
        self.start = time.perf_counter()
        self.started = step.begin(state)
        self.buffers = self.started.buffers
        scaler = step.loss_scaler
        self.scale = None if scaler is None else float(state.loss_scale.scale)
        self.sums = _StepSums(grad_spec(state.params.spec), step.sum_home)
        self.passes: list[_Pass] = []  # open: awaiting a backward
        self.losses: list[torch.Tensor] = []  # one per backward
        self.unreduced = False  # whole gradients were added since the last reduction
        self.peak = 0
        self.prefetch: tuple = ()
        self.live: dict = {}  # which parameters the backwards so far gave a gradient (GradOut.live)
        self.tokens = 0

    def close(self, passes: list[_Pass], error: BaseException | None = None) -> None:
        for p in passes:
            self.passes.remove(p)
            p.close(error)
            self.peak = max(self.peak, p.tracker.peak)
            self.prefetch += p.tracker.prefetch
            self.live = merge_live(self.live, p.tracker.got)

    def close_orphans(self) -> None:
        self.close([p for p in self.passes if p.orphaned], _Unfinished())

    def forward(self, step: Step, state, forward_fn: Callable, batch):
        """One ``engine(batch)`` with gradients on: a pass whose materialization stays open until a
        backward goes through it."""
        with step.continuing():
            p = _Pass(materialized(state.params, state.frozen, self.buffers, differentiable=True), self.sums)
            self.passes.append(p)
            try:
                out = run_forward(forward_fn, p.view, p.tracker, batch)
            except BaseException as e:
                self.close([p], e)
                raise
        p.watch(out)
        if out is None:  # nothing to go back through (a model's method that computes nothing)
            self.close([p], _Unfinished())
        return out

    def backward(self, step: Step, loss: torch.Tensor, last: bool, retain_graph: bool, factor: float = 1.0) -> None:
        """Add ``loss``'s gradients to the step's sums, times ``factor`` (``grad_out`` divides the sums
        by the accumulation steps: a loss the caller already scaled comes with ``factor`` = those
        steps); ``last``: the accumulation boundary's backward, which reduces whole gradients. An
        error closes every pass (the sums are incomplete: the caller abandons the step)."""
        sums = self.sums
        sums.last = last
        sums.reached = set()
        try:
            with step.continuing(), lazy.resolving(self.passes[-1].tracker):
                scale = factor if self.scale is None else factor * self.scale
                torch.autograd.backward(loss if scale == 1.0 else loss * scale, retain_graph=retain_graph)
                if not retain_graph:  # their gradients are all in: their gathered buffers go
                    self.close([p for p in self.passes if p.tracker in sums.reached])
        except BaseException as e:
            self.close(list(self.passes), e)
            raise
        sums.reached = set()
        self.unreduced = not last
        self.losses.append(loss.detach().reshape(()))

    def drop(self) -> None:
        """Close the passes no backward went through (their order is not recorded as a trace)."""
        self.close(list(self.passes), _Unfinished())

    def grad_out(self, group, accumulation_steps: int) -> GradOut:
        """The step's gradients, for ``Step.apply_gradients``: the sums of every backward, whole
        gradients reduced over ``group`` if no backward came since the boundary, scaled by
        ``1/accumulation_steps`` (and fp16's loss scale)."""
        grads = self.sums.grads()
        if self.unreduced:  # no backward since the boundary came: reduce whole gradients now
            _reduce_whole(grads, group)
        return GradOut(torch.stack(self.losses).mean(), None, grads, self.peak,
                       (1.0 if self.scale is None else 1.0 / self.scale) / accumulation_steps,
                       self.prefetch, self.live)


def _reduce_whole(grads: Params, group) -> None:
    """Average the gradients that go home whole (stage 0, zero1) over ``group`` (the step's
    agreement group: every rank of a mesh), and under hybrid sharding the shards over their
    replicas: what the accumulator does in the boundary's backward (zfunc.transforms.accumulate),
    when none came."""
    for g, sharded, place in zip(grads.leaves, grads.spec.sharded, grads.spec.placements):
        if g is not None and sharded and place.replicate is not None:
            if swap.on_disk(g):
                raise ValueError("engine.step() at the accumulation boundary with no engine.backward since the last "
                                 "step(): with gradients on NVMe, run the boundary micro-batch's backward")
            replicate_mean(place, g)
        if g is None or sharded:
            continue
        if swap.on_disk(g):
            raise ValueError("engine.step() at the accumulation boundary with no engine.backward since the last "
                             "step(): with gradients on NVMe, run the boundary micro-batch's backward")
        dist.all_reduce_mean(g, group)
