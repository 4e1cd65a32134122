"""Steps: ``(state, batch) -> (state, metrics)`` and the transforms' shared plan.

A ``Step`` is a loss function, an optimizer and a ``Plan``. The plan is the
static record of the transforms applied so far (ZeRO stage, units, group);
transforms return a new step with a new plan. ``init`` builds the state in the
representation the plan asks for, ``__call__`` runs one optimizer step on it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from . import dist
from .grad import ParamView, value_and_grad_with_stats
from .materialize import Tracker, Units
from .state import State
from .tree import Params, ParamsSpec, Placement, build_spec, flatten_segment


@dataclass(frozen=True)
class Plan:
    """What the transforms applied so far ask of the state and the step."""

    stage: int = 0
    units: Any = None
    group: Any = None
    persistence_threshold: int = 0

    def placement(self, numel: int) -> Placement:
        if self.stage == 3 and numel >= self.persistence_threshold:
            return Placement(True, True, True)
        if self.stage >= 2:
            return Placement(False, True, True)
        return Placement(False, False, self.stage == 1)

    def signature(self) -> tuple:
        """What a state must agree on with the step it is passed to."""
        return (self.stage, dist.world_size(self.group), self.persistence_threshold)


class Step:
    """One optimizer step of ``loss_fn`` with ``optimizer``, as the plan shards it.

    The step donates its input state: parameters and optimizer state are
    updated in place and returned, so keep using the returned state only.
    """

    def __init__(self, loss_fn: Callable, optimizer, plan: Plan = Plan(), has_aux: bool = False):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.plan = plan
        self.has_aux = has_aux

    def with_plan(self, **changes) -> "Step":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, plan=replace(self.plan, **changes))
        return new

    def init(self, model: nn.Module, *, free_model: bool = True) -> State:
        """Build the state from ``model``'s parameters and buffers.

        With ``free_model`` (the default) the model's parameters are replaced
        by meta tensors afterwards: the state owns them now; run the model
        with ``zf.apply``.
        """
        plan = self.plan
        w, r = dist.world_size(plan.group), dist.rank(plan.group)
        spec = build_spec(model, plan.units, w)
        place = tuple(plan.placement(u.trainable.numel + u.frozen.numel) for u in spec.units)

        def make(frozen: bool) -> Params:
            segs = [u.frozen if frozen else u.trainable for u in spec.units]
            leaves = []
            for seg, p in zip(segs, place):
                flat = flatten_segment(model, seg)
                if w > 1:
                    dist.broadcast(flat, 0, plan.group)  # every rank starts from rank 0's weights
                n = seg.padded // w
                leaves.append(flat[r * n : (r + 1) * n].clone() if p.params_sharded else flat)
            sharded = tuple(p.params_sharded for p in place)
            return Params(ParamsSpec(spec, place, sharded, frozen, plan.group), leaves)

        params, frozen = make(False), make(True)
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        for b in buffers.values():
            dist.broadcast(b, 0, plan.group)
        opt_state = self.optimizer.init(params.local()) if self.optimizer is not None else None
        if free_model:
            _free_parameters(model)
        return State(params, opt_state, frozen, buffers, plan.signature())

    def _check(self, state: State) -> None:
        if not isinstance(state, State):
            raise TypeError(f"a step takes a zfunc State (from step.init(model)), got {type(state).__name__}")
        if state.plan != self.plan.signature():
            stage, w, thr = state.plan
            raise ValueError(
                f"this state was built by a step with ZeRO stage {stage} at world size {w} "
                f"(persistence threshold {thr}), but this step is stage {self.plan.stage} at world size "
                f"{dist.world_size(self.plan.group)}: build the state with this step's init, or "
                "reshard it through a checkpoint"
            )

    def _buffers(self, state: State) -> dict:
        """Fresh buffers for this step: rank 0's, as DDP broadcasts them before each forward."""
        buffers = {k: v.clone() for k, v in state.buffers.items()}
        for b in buffers.values():
            dist.broadcast(b, 0, self.plan.group)
        return buffers

    def __call__(self, state: State, batch) -> tuple[State, dict]:
        self._check(state)
        buffers = self._buffers(state)
        vg = value_and_grad_with_stats(self.loss_fn, self.has_aux)
        loss, aux, grads, peak = vg(state.params, batch, frozen=state.frozen, buffers=buffers)
        local_grads = grads.local()
        metrics = {
            "loss": dist.all_reduce_mean(loss.float().clone(), self.plan.group),
            "grad_bytes": grads.nbytes(),
            "peak_materialized_bytes": peak,
        }
        if self.has_aux:
            metrics["aux"] = aux
        del grads
        local, opt_state = self.optimizer.update(local_grads, state.opt_state, state.params.local())
        params = state.params.from_local(local)
        return State(params, opt_state, state.frozen, buffers, state.plan), metrics


class EvalStep(Step):
    """``(state, batch) -> metrics``: the loss under the same sharding, no update."""

    def __init__(self, loss_fn: Callable, plan: Plan = Plan(), has_aux: bool = False):
        super().__init__(loss_fn, None, plan, has_aux)

    @torch.no_grad()
    def __call__(self, state: State, batch) -> dict:
        self._check(state)
        tracker = Tracker()
        view = ParamView(state.params.spec.model, Units(state.params, tracker), Units(state.frozen, tracker),
                         self._buffers(state))
        try:
            out = self.loss_fn(view, batch)
        finally:
            view.close()
            tracker.close()
        loss = out[0] if self.has_aux else out
        metrics = {"loss": dist.all_reduce_mean(loss.detach().float().clone(), self.plan.group)}
        if self.has_aux:
            metrics["aux"] = out[1]
        return metrics


def _free_parameters(model: nn.Module) -> None:
    """Swap every parameter for a meta tensor of the same shape (ties kept)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]


def train_step(loss_fn: Callable, optimizer, *, has_aux: bool = False) -> Step:
    """The base step: ``value_and_grad(loss_fn)`` then ``optimizer``. Replicated, like DDP."""
    return Step(loss_fn, optimizer, Plan(), has_aux)


def eval_step(loss_fn: Callable, *, has_aux: bool = False) -> EvalStep:
    """Evaluate ``loss_fn`` on a state; compose with the same transforms as the train step."""
    return EvalStep(loss_fn, Plan(), has_aux)
