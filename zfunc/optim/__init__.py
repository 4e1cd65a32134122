"""Optimizers as pure ``(init, update)`` pairs over pytrees, optax-style. Part of the core: steps
and transforms stand on it.

``base``: the protocols and ``apply_update``; ``combine``: ``chain`` and clipping; ``optimizers``:
adamw, adam, sgd; ``groups``: per-parameter hyperparameters (torch's param groups); ``counts``: their
update counts and which parts an update touches; ``lr``: the learning-rate schedules; ``reported_lr``: which lr a step reports (``metrics["lr"]``)."""
from . import lr
from .base import EmptyState, GradInfo, GradientTransformation, Optimizer, PyTree, apply_update
from .combine import chain, clip_by_global_norm
from .groups import Group, group
from .lr import (ScalarOrSchedule, Schedule, as_schedule, constant, cosine_decay, linear_schedule, linear_warmup,
                 warmup_cosine_decay, warmup_cosine_lr, warmup_decay_lr, warmup_lr)
from .optimizers import AdamState, SgdState, adam, adamw, sgd

__all__ = [
    "AdamState", "EmptyState", "GradInfo", "GradientTransformation", "Group", "Optimizer", "PyTree", "ScalarOrSchedule",
    "Schedule", "SgdState", "adam", "adamw", "apply_update", "as_schedule", "chain", "clip_by_global_norm",
    "constant", "cosine_decay", "group", "linear_schedule", "linear_warmup", "lr", "sgd", "warmup_cosine_decay",
    "warmup_cosine_lr", "warmup_decay_lr", "warmup_lr",
]
