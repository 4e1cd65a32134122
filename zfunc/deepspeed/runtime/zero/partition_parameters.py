"""``deepspeed.runtime.zero.partition_parameters``: ``ZeroParamStatus``, ``Init`` and
``GatheredParameters`` as DeepSpeed-Chat and transformers import them (zfunc.deepspeed.zero's:
under ZeRO-3 the engine's parameters carry ``ds_id`` and ``ds_status``, NOT_AVAILABLE outside
``GatheredParameters``, so a script's "gather first" branch is taken).

``zero_wrapper_for_fp_tensor_constructor`` and ``_orig_torch_arange`` are here because transformers
swaps the first around DeepSpeed's ``Init`` (``prevent_arange_dtype_change``, so RoPE buffers
keep their dtype) and restores it after. zfunc's ``Init`` is the meta device and wraps no tensor
constructor, so nothing calls them; the wrapper, called, only puts tensors on the device asked.
"""
from __future__ import annotations

import torch

from ...zero import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                     unregister_external_parameter)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """``fn`` with its tensors put on ``target_device`` when the call names no device."""

    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        return fn(*args, **kwargs)

    return wrapped
