"""Optimizers as pure ``(init, update)`` pairs over pytrees, optax-style. Part of the core: steps
and transforms stand on it.

``base``: the protocols and ``apply_update``; ``combine``: ``chain`` and clipping; ``optimizers``:
adamw, adam, sgd; ``whole``: optimizers whose update needs whole parameters, and ``owners``: which
rank updates each under ZeRO; ``muon``, ``adafactor``: two of them; ``torch_adapter``: any ``torch.optim`` class
(``from_torch``); ``multi``: different optimizers for different parameters; ``groups``: per-parameter hyperparameters (torch's param groups); ``counts``: their
update counts and which parts an update touches; ``lr``: the learning-rate schedules; ``reported_lr``: which lr a step reports (``metrics["lr"]``)."""
from . import lr
from .base import EmptyState, GradInfo, GradientTransformation, Optimizer, PyTree, apply_update
from .combine import chain, clip_by_global_norm
from .groups import Group, group
from .lr import (ScalarOrSchedule, Schedule, as_schedule, constant, cosine_decay, linear_schedule, linear_warmup,
                 warmup_cosine_decay, warmup_cosine_lr, warmup_decay_lr, warmup_lr)
from .adafactor import adafactor
from .multi import multi
from .muon import muon
from .optimizers import AdamState, SgdState, adam, adamw, sgd
from .torch_adapter import from_torch
from .whole import WholeState

__all__ = [
    "AdamState", "EmptyState", "GradInfo", "GradientTransformation", "Group", "Optimizer", "PyTree", "ScalarOrSchedule",
    "Schedule", "SgdState", "WholeState", "adafactor", "adam", "adamw", "apply_update", "as_schedule", "chain", "clip_by_global_norm",
    "constant", "cosine_decay", "from_torch", "group", "linear_schedule", "linear_warmup", "lr", "multi", "muon", "sgd", "warmup_cosine_decay",
    "warmup_cosine_lr", "warmup_decay_lr", "warmup_lr",
]
