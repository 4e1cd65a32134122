"""``deepspeed.utils``: DeepSpeed's utilities that scripts and transformers import.

- ``logger``, ``log_dist`` (``deepspeed.utils.logging``, whose ``logger`` Lightning sets the level
  of): a logger named ``DeepSpeed``, and logging from chosen ranks;
- ``RepeatingLoader``: zfunc's; ``timer.ThroughputTimer``: the engine's ``tput_timer``;
- ``safe_get_full_fp32_param(param)`` / ``safe_set_full_fp32_param(param, value)``: a parameter's
  full fp32 value read from, or written into, the engine's state through
  ``zero.GatheredParameters`` (collective, as DeepSpeed's are under ZeRO-3: every rank calls them;
  the write takes rank 0's ``value``, which DeepSpeed expects to be every rank's);
- ``set_z3_leaf_modules`` and friends: DeepSpeed's ZeRO-3 hint to fetch a module's parameters
  together (for mixture-of-experts layers); recorded on the modules, and it changes nothing here:
  zfunc gathers parameters by unit, never one by one;
- ``recursive_getattr`` / ``recursive_setattr``;
- ``zero_to_fp32``: a checkpoint's fp32 weights as one ``state_dict`` (its module docstring).

Refused, named: ``safe_get_full_grad`` / ``safe_get_full_optimizer_state`` and their ``set`` and
``local`` forms (zfunc's gradients live inside the step, its moments in the state's shards; read
them with ``zf.gather_params`` / a checkpoint). ``groups``: the data-parallel group is the world's;
sequence-parallel and expert groups are refused.
"""
from __future__ import annotations

import torch

from ...engine import RepeatingLoader
from ..compression.helper import recursive_getattr, recursive_setattr
from ..zero import GatheredParameters
from . import groups, logging, timer, zero_to_fp32
from .logging import log_dist, logger

__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "log_dist", "logger", "recursive_getattr", "recursive_setattr",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "z3_leaf_module"]

# ----------------------------------------------------------------- parameters


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The full fp32 value of ``param`` (a copy), gathered from the engine's state; every rank calls it."""
    with GatheredParameters([param]):
        return param.detach().float().clone()


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` (rank 0's) as ``param``'s full fp32 value into every copy the engine keeps;
    the optimizer's moments are kept. Every rank calls it."""
    with GatheredParameters([param], modifier_rank=0), torch.no_grad():
        param.copy_(value)


def _refuse(name: str, what: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(f"deepspeed.utils.{name}: {what} is not offered by zfunc: gradients live inside "
                                  "the step (clip or scale them through the config), the optimizer's moments in the "
                                  "state's shards (engine.save_checkpoint writes them); parameters are read and "
                                  "written with safe_get_full_fp32_param / safe_set_full_fp32_param")
    refused.__name__ = name
    return refused


safe_get_full_grad = _refuse("safe_get_full_grad", "reading a parameter's gradient")
safe_set_full_grad = _refuse("safe_set_full_grad", "writing a parameter's gradient")
safe_get_local_grad = _refuse("safe_get_local_grad", "reading a parameter's gradient")
safe_get_full_optimizer_state = _refuse("safe_get_full_optimizer_state", "reading the optimizer's state")
safe_set_full_optimizer_state = _refuse("safe_set_full_optimizer_state", "writing the optimizer's state")
safe_get_local_optimizer_state = _refuse("safe_get_local_optimizer_state", "reading the optimizer's state")
safe_get_local_fp32_param = _refuse("safe_get_local_fp32_param", "reading this rank's shard of a parameter")


# ------------------------------------------------------------- ZeRO-3 leaves

_LEAF = "_z3_leaf"


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes) -> list[torch.nn.Module]:
    """Mark the modules of ``model`` whose class (or class name) is in ``leaf_module_classes``;
    returns them, and raises if none matched (as DeepSpeed does). Changes nothing here (see the
    module docstring)."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes) -> list[torch.nn.Module]:
    return _mark(model, leaf_module_classes, False)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return getattr(model, _LEAF, False)


def _mark(model, classes, flag: bool) -> list:
    classes = list(classes)
    names = {c for c in classes if isinstance(c, str)}
    types = tuple(c for c in classes if isinstance(c, type))
    hit = [m for m in model.modules() if isinstance(m, types) or type(m).__name__ in names]
    if not hit:
        raise ValueError(f"no module of the model is one of {classes}")
    for m in hit:
        setattr(m, _LEAF, flag)
    return hit
