"""Which learning rate a step reports as ``metrics["lr"]``, and the lr of the next update.

A schedule sees the optimizer's own update count (its state's ``count``: updates applied before
the current one, 0 for the first), not the step count: a step skipped for non-finite gradients
applies no update and does not advance it, as DeepSpeed steps its scheduler only after an applied
update. So the rules, one place for the step and the engines:

* an applied update reports the lr it used, as the optimizer recorded it (``GradInfo.lrs``): the
  first one recorded where several optimizers update (one lr per param group, as DeepSpeed's
  ``get_lr()[0]`` is the one its logs print);
* a skipped step reports the lr its update would have used, which is the lr the next applied
  update uses (``metrics["skipped"]`` says it was not applied);
* an optimizer that records nothing and carries no schedule (``Optimizer.lr``) reports None.
"""
from __future__ import annotations

import optree

from .base import GradInfo
from ..pytree import NAMESPACE


def update_count(opt_state) -> int | None:
    """The updates applied so far: the ``count`` of the first optimizer state in ``opt_state`` (a
    NamedTuple with a ``count`` field, inside whatever states the transforms wrap it in); None when
    there is none."""
    def is_counted(x) -> bool:
        return "count" in getattr(type(x), "_fields", ())

    for node in optree.tree_leaves(opt_state, is_leaf=is_counted, none_is_leaf=True, namespace=NAMESPACE):
        if is_counted(node):
            return int(node.count)
    return None


def next_lr(optimizer, opt_state) -> float | None:
    """The lr ``optimizer``'s next update will use: its schedule at its update count in
    ``opt_state``; None when it carries no schedule or its state no count."""
    schedule = getattr(optimizer, "lr", None)
    count = update_count(opt_state)
    if schedule is None or count is None:
        return None
    return float(schedule(count))


def applied_lr(info: GradInfo) -> float | None:
    """The lr an applied update used: the first its optimizers recorded; None if none did."""
    return float(info.lrs[0]) if info.lrs else None
