"""DeepSpeed's ``save_16bit_model``: the model's whole ``state_dict`` in the dtype the model computes
in, written by rank 0 with ``torch.save``.

DeepSpeed casts the module to fp16 / bf16 when either is enabled (``module.half()``,
``module.bfloat16()``: parameters and floating buffers), so its file holds those; in fp32 the
fp32 weights. Under ZeRO-3 it writes only when the config's
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (or one of its other names) is
true, and otherwise returns False without writing; the same here. Tied parameters are one tensor
under each of their names, as in ``state_dict()``.
"""
from __future__ import annotations

import os
import warnings

import torch

from .. import dist
from ..state import gather_params

# DeepSpeed 0.19's names for the switch (its config model takes each)
GATHER_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
               "stage3_gather_fp16_weights_on_model_save")


def gathers_on_save(config) -> bool:
    """Whether the config's ``zero_optimization`` asks ZeRO-3 to gather the 16-bit weights on save."""
    zero = config.raw.get("zero_optimization") or {}
    return any(zero.get(k) is True for k in GATHER_KEYS)


def state_dict(state, keys: list[str], dtype: torch.dtype | None,
               params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` (``keys``, its order) from ``state``: parameters (``params``, by
    default the fp32 weights gathered: every rank calls it) and persistent buffers, floating tensors
    cast to ``dtype``."""
    spec = state.params.spec.model
    params = gather_params(state) if params is None else params
    out: dict[str, torch.Tensor] = {}
    by_canonical: dict[str, torch.Tensor] = {}
    for key in keys:
        name = spec.canonical_name(key)
        if name in by_canonical:  # a tied name: the same tensor, as state_dict() gives it
            out[key] = by_canonical[name]
            continue
        if name in params:
            t = params[name]
        elif key in state.buffers:
            t = state.buffers[key].detach().to("cpu", copy=True)
        else:
            raise KeyError(f"the model's state_dict key {key!r} is neither a parameter nor a buffer of the state")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[key] = by_canonical[name] = t
    return out


def save(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """``engine.save_16bit_model``: see the module docstring. Every rank calls it."""
    if exclude_frozen_parameters:
        raise NotImplementedError("save_16bit_model(exclude_frozen_parameters=True) is not supported yet: the file "
                                  "holds every parameter")
    path = os.path.join(save_dir, save_filename)
    if engine.zero_optimization_partition_weights() and not gathers_on_save(engine.config):
        warnings.warn(f"did not save {path}: under ZeRO-3 DeepSpeed writes the 16-bit model only when "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save is true", UserWarning, stacklevel=3)
        return False
    weights = state_dict(engine.state, engine.state_dict_keys, engine.config.compute_dtype)
    if dist.rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(weights, path)
    dist.barrier()
    return True
