"""``deepspeed.runtime.utils``: the helpers scripts call from it (``set_random_seed``,
``move_to_device``)."""
from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["move_to_device", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (DeepSpeed's: the same three)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def move_to_device(item, device, criterion_func=torch.is_tensor):
    """``item`` with each tensor in it (nested lists, tuples, dicts) moved to ``device``."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item
