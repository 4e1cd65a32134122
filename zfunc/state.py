"""The training state: a pytree of sharded parameters, optimizer state and buffers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import dist
from .pytree import register_node, tree_leaves
from .tree import Params


@dataclass(frozen=True)
class State:
    """Everything a step reads and returns. An optree/torch pytree.

    ``params``: trainable parameters (one flat leaf per unit). ``opt_state``:
    the optimizer's state over this rank's part of ``params``. ``frozen``:
    parameters that get no gradient. ``buffers``: ``name -> Tensor``,
    unsharded. ``count``: steps taken (0-d int64, skipped steps included).
    ``plan``: the static record of the step that made it (its composition
    and world size), checked when the state is passed to a step.
    """

    params: Params
    opt_state: Any
    frozen: Params
    buffers: dict
    count: torch.Tensor
    plan: Any = None


register_node(
    State,
    lambda s: ((s.params, s.opt_state, s.frozen, s.buffers, s.count), s.plan),
    lambda plan, children: State(*children, plan=plan),
)


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def memory_report(state: State) -> dict[str, int]:
    """Bytes this rank holds for each part of the model state (DESIGN.md §3 memory)."""
    return {
        "param_bytes": state.params.nbytes(),
        "optimizer_bytes": _nbytes(state.opt_state),
        "frozen_bytes": state.frozen.nbytes(),
        "buffer_bytes": _nbytes(state.buffers),
    }


def gather_params(state: State) -> dict[str, torch.Tensor]:
    """Full fp32 parameters keyed like ``model.named_parameters()``, on every rank, on CPU."""
    out: dict[str, torch.Tensor] = {}
    for params in (state.params, state.frozen):
        spec = params.spec
        for i, (leaf, sharded) in enumerate(zip(params.leaves, spec.sharded)):
            full = dist.all_gather(leaf.detach(), spec.process_group) if sharded else leaf.detach()
            for name, t in spec.segment(i).unflatten(full).items():
                out[name] = t.to(device="cpu", dtype=torch.float32, copy=True)
    order = [n for n, _ in spec.model.owner if spec.model.canonical_name(n) == n]
    return {name: out[name] for name in order}
