"""``deepspeed.utils.zero_to_fp32``: a checkpoint's fp32 weights as one ``state_dict``, for the
scripts that turn a ZeRO checkpoint into a plain model after training (Hugging Face's docs' recipe).

The checkpoint is zfunc's (``engine.save_checkpoint``: any stage and world size; zfunc.checkpoint
reads it), found as DeepSpeed finds its own: ``checkpoint_dir`` holds the tag folders and the
``latest`` file that names one. The ``state_dict`` is the model's own (parameters, tied names,
persistent buffers), the fp32 master weights under mixed precision, as DeepSpeed's is.

- ``get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
  lazy_mode=False)``; ``lazy_mode`` gives the same tensors (what DeepSpeed's lazy values give through
  ``.contiguous()``, which a tensor has too);
- ``convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=, max_shard_size=,
  safe_serialization=, tag=, exclude_frozen_parameters=)`` and its fp32 form
  ``convert_zero_checkpoint_to_fp32_state_dict``: ``pytorch_model.bin`` or ``model.safetensors``
  in ``output_dir``, sharded as Hugging Face shards (``-00001-of-00002`` and an index) past
  ``max_shard_size``; each file written whole or not at all;
- ``load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None)``: the weights loaded
  into ``model`` on the CPU (a model an engine held gets parameters of its own again), returned.

DeepSpeed's readers of its own files (``get_model_state_file``, ``get_optim_files``: Lightning's
converter opens them) have nothing to read in zfunc's checkpoints and are refused, named.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from ... import lazy
from ...checkpoint import consolidate
from ...checkpoint.files import write_text
from ...checkpoint.hf_files import DTYPES, Planned, parse_size, split

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file", "get_optim_files",
           "load_state_dict_from_zero_checkpoint"]

def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 ``state_dict`` on the CPU (the module docstring)."""
    return consolidate(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str, dtype=torch.float32,
                                          max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> None:
    """The checkpoint's weights written to ``output_dir`` in ``dtype`` (floating tensors; others as
    they are), one file or Hugging Face's shards and index."""
    dtype = _dtype(dtype)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    plan = [Planned(k, tuple(t.shape), dtype if t.is_floating_point() else t.dtype) for k, t in state_dict.items()]
    shards = [plan] if max_shard_size is None else split(plan, parse_size(max_shard_size))
    stem, ext = os.path.splitext(weights)
    names = [weights] if len(shards) == 1 else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    os.makedirs(output_dir, exist_ok=True)
    written: list[str] = []
    try:
        for name, shard in zip(names, shards):
            # a copy of each tensor: tied names share storage, which safetensors refuses
            tensors = {t.name: state_dict[t.name].to(t.dtype, copy=True).contiguous() for t in shard}
            written.append(_write(os.path.join(output_dir, name), tensors, safe_serialization))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in plan)},
                     "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
            path = os.path.join(output_dir, f"{weights}.index.json")
            write_text(path, json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(path)
    except BaseException:
        for path in written:
            os.remove(path)
        raise


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """``convert_zero_checkpoint_to_state_dict`` in fp32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                          safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str, tag: str | None = None) -> nn.Module:
    """``model`` on the CPU holding the checkpoint's fp32 weights (``load_state_dict(strict=False)``);
    an engine's stand-ins in it are replaced by parameters of the model's own, so it leaves the
    engine, as DeepSpeed's leaves its engine's hooks behind."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    own: dict[int, nn.Parameter] = {}
    replaced = []
    for path, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and lazy.is_lazy(p):
                if id(p) not in own:  # tied slots share one parameter, as they shared the stand-in
                    own[id(p)] = nn.Parameter(torch.full(p.shape, float("nan")), requires_grad=p.requires_grad)
                module._parameters[attr] = own[id(p)]
                replaced.append(f"{path}.{attr}" if path else attr)
    model = model.cpu()
    missing = set(model.load_state_dict(state_dict, strict=False).missing_keys)
    unset = [name for name in replaced if name in missing]
    if unset:
        raise ValueError(f"load_state_dict_from_zero_checkpoint: checkpoint {checkpoint_dir!r} lacks {unset[:3]} "
                         f"({len(unset)} in all) of the engine's weights in the model, which now hold NaN: load the "
                         "checkpoint of this model")
    return model


def get_model_state_file(checkpoint_dir, zero_stage):
    raise NotImplementedError("deepspeed.utils.zero_to_fp32.get_model_state_file: zfunc's checkpoints hold no "
                              "DeepSpeed model-state files; read the weights with "
                              "get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)")


def get_optim_files(checkpoint_dir):
    raise NotImplementedError("deepspeed.utils.zero_to_fp32.get_optim_files: zfunc's checkpoints hold no DeepSpeed "
                              "optimizer-state files; read the weights with get_fp32_state_dict_from_zero_checkpoint("
                              "checkpoint_dir), or resume with engine.load_checkpoint")


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r}: give torch.float32, torch.float16 or torch.bfloat16 (or 'fp32', 'fp16', "
                     "'bf16')")


def _write(path: str, tensors: dict, safe: bool) -> str:
    """``tensors`` to ``path`` whole or not at all: safetensors (``safe``) or torch.save."""
    part = f"{path}.partial"
    try:
        if safe:
            import safetensors.torch
            safetensors.torch.save_file(tensors, part, metadata={"format": "pt"})
        else:
            torch.save(tensors, part)
        os.replace(part, path)
    except BaseException:
        if os.path.exists(part):
            os.remove(part)
        raise
    return path
