"""Which tensors of a training state make each part that ``zf.offload_states`` moves, and the
names ``include=`` takes: zfunc's own and DeepSpeed's (``OffloadStateTypeEnum``)."""
from __future__ import annotations

import optree
import torch

from ..pytree import NAMESPACE
from ..state import INNER, wrapper_role
from ..tree import Params

PARTS = ("params", "frozen", "master", "optimizer")

# DeepSpeed's OffloadStateTypeEnum values, as zfunc's parts. zfunc keeps no gradient between steps
# (a step's gradients and accumulation sums live inside the step), so the two gradient kinds name
# nothing to move.
DEEPSPEED_NAMES = {
    "lp_params": ("params", "frozen"),  # the parameters the model computes with
    "hp_params": ("master",),  # the optimizer's full-precision copy (mixed precision, offload_cpu)
    "optim_states": ("optimizer",),  # the optimizer's moments and counts
    "lp_grads": (),
    "contiguous_grad_buffer": (),
}


def chosen(include) -> tuple[str, ...]:
    """The parts ``include`` names (None: all), in ``PARTS`` order; a name neither zfunc's nor
    DeepSpeed's is refused."""
    if include is None:
        return PARTS
    if isinstance(include, str) or hasattr(include, "value"):
        include = [include]
    out = set()
    for item in include:
        name = getattr(item, "value", item)  # an OffloadStateTypeEnum member
        if name in PARTS:
            out.add(name)
        elif name in DEEPSPEED_NAMES:
            out.update(DEEPSPEED_NAMES[name])
        else:
            raise ValueError(f"include={include!r}: {name!r} is not a part of a training state; name some of "
                             f"{', '.join(PARTS)} or DeepSpeed's {', '.join(DEEPSPEED_NAMES)}")
    return tuple(p for p in PARTS if p in out)


def part_of(accessor) -> str | None:
    """The part of the state a leaf (or ``Params`` node) at ``accessor`` belongs to; None for what
    never moves (buffers, the step count, the loss scale: a few bytes each)."""
    field = accessor[0].entry
    if field in ("params", "frozen"):
        return field
    if field != "opt_state":
        return None
    for entry in accessor[1:]:
        fields = getattr(entry.type, "_fields", ())
        if isinstance(entry.entry, int) and entry.entry < len(fields):
            role = wrapper_role(entry.type, fields[entry.entry])
            if role is not None and role != INNER:  # mixed precision's master, offload_cpu's host copy
                return "master"
    return "optimizer"


def tensors_by_part(state) -> list[tuple[str | None, torch.Tensor]]:
    """Every tensor of ``state`` with its part (``part_of``), once per object, values complete (waits for
    the gathers and updates still writing them)."""
    accessors, nodes, _ = optree.tree_flatten_with_accessor(state, is_leaf=lambda x: isinstance(x, Params),
                                                            namespace=NAMESPACE)
    out, seen = [], set()
    for accessor, node in zip(accessors, nodes):
        part = part_of(accessor)
        tensors = node.leaves if isinstance(node, Params) else [node]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append((part, t))
    return out


def map_tensors(state, fn):
    """``state`` with every tensor ``t`` replaced by ``fn(t)``, in new ``Params`` nodes (their spec and
    pieces kept, no fault): a state that shares no node with ``state``."""
    def node(x):
        if isinstance(x, Params):
            return Params(x.spec, [None if t is None else fn(t) for t in x.leaves], starts=x._starts)
        return fn(x) if isinstance(x, torch.Tensor) else x
    return optree.tree_map(node, state, is_leaf=lambda x: isinstance(x, Params), namespace=NAMESPACE)
