"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""
from __future__ import annotations

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``item`` with every tensor in it (nested lists, tuples, dicts) replaced by a detached copy on
    ``device``, so ``torch.save`` writes only each tensor's own elements, not the storage it views."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
