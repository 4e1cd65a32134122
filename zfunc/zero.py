"""ZeRO stages 1, 2 and 3 as step transforms.

Each transform only changes the step's plan: which leaves are sharded
(parameters, gradients, optimizer state). Materialization (zfunc.materialize)
and the step's optimizer call (``Params.local`` / ``from_local``) do the rest.

| stage | parameters | gradients | optimizer state |
| --- | --- | --- | --- |
| 0 (``train_step``) | replicated | all-reduced | replicated |
| 1 | replicated | all-reduced | sharded |
| 2 | replicated | reduce-scattered | sharded |
| 3 | sharded, gathered per unit | reduce-scattered | sharded |
"""
from __future__ import annotations

from .step import Step


def _zero(step: Step, stage: int, **plan) -> Step:
    if not isinstance(step, Step):
        raise TypeError(f"zero{stage} transforms a zfunc Step (zf.train_step or zf.eval_step), got {type(step).__name__}")
    if step.plan.stage != 0:
        raise ValueError(
            f"this step is already ZeRO stage {step.plan.stage}; apply one of zero1/zero2/zero3, once"
        )
    return step.with_plan(stage=stage, **plan)


def zero1(step: Step, *, group=None) -> Step:
    """Shard optimizer state across ``group`` (default: the whole world)."""
    return _zero(step, 1, group=group)


def zero2(step: Step, *, group=None) -> Step:
    """Shard optimizer state and reduce-scatter gradients."""
    return _zero(step, 2, group=group)


def zero3(step: Step, units=None, *, group=None, persistence_threshold: int = 0) -> Step:
    """Shard parameters too: each unit is gathered just before its module runs.

    ``units``: ``None`` (each child of every ``nn.ModuleList`` plus a root
    unit), a list of module names, or a predicate ``(name, module) -> bool``.
    Units with fewer than ``persistence_threshold`` elements stay replicated.
    """
    return _zero(step, 3, units=units, group=group, persistence_threshold=persistence_threshold)
