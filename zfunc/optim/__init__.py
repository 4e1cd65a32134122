"""Optimizers as pure ``(init, update)`` pairs over pytrees, optax-style, and learning-rate
schedules (``zfunc.optim.lr``). Part of the core: steps and transforms stand on it."""
from . import lr
from .lr import (ScalarOrSchedule, Schedule, as_schedule, constant, cosine_decay, linear_schedule, linear_warmup,
                 warmup_cosine_decay, warmup_cosine_lr, warmup_decay_lr, warmup_lr)
from .optimizers import (AdamState, EmptyState, GradInfo, GradientTransformation, Optimizer, PyTree, SgdState, adam,
                         adamw, apply_update, chain, clip_by_global_norm, sgd)

__all__ = [
    "AdamState", "EmptyState", "GradInfo", "GradientTransformation", "Optimizer", "PyTree", "ScalarOrSchedule",
    "Schedule", "SgdState", "adam", "adamw", "apply_update", "as_schedule", "chain", "clip_by_global_norm",
    "constant", "cosine_decay", "linear_schedule", "linear_warmup", "lr", "sgd", "warmup_cosine_decay",
    "warmup_cosine_lr", "warmup_decay_lr", "warmup_lr",
]
