"""A model as the estimator sees it: its units' sizes, from a Hugging Face config or a module (on
the meta device, so a model of any size costs no memory), laid out by zfunc's own unit rules."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from .. import tree


@dataclass(frozen=True)
class UnitShape:
    """One unit: its trainable and frozen element counts and dtypes, and how many parameters it holds
    (the optimizer keeps one update count per parameter)."""

    name: str
    trainable: int
    trainable_entries: int
    frozen: int
    dtype: torch.dtype
    frozen_dtype: torch.dtype


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its units in the order forward first uses them (module
    order), its buffers, and a training step's floating-point operations per token."""

    units: tuple[UnitShape, ...]
    buffer_bytes: tuple[int, ...]  # one per buffer the step broadcasts from rank 0
    flops_per_token: float

    @property
    def trainable(self) -> int:
        return sum(u.trainable for u in self.units)

    @property
    def frozen(self) -> int:
        return sum(u.frozen for u in self.units)


def _from_config(config) -> nn.Module:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isfile(path):
            with open(path) as f:
                return _from_config(json.load(f))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"zf.estimate: no config at {path!r}: give a model's local folder or its "
                                    "config.json (nothing is downloaded)")
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a dependency of the examples
        raise ImportError("zf.estimate: a Hugging Face config needs transformers installed "
                          "(pip install transformers), or pass the model as a module on the meta device") from e
    if isinstance(config, dict):
        kind = config.get("model_type")
        if kind is None:
            raise ValueError("zf.estimate: a config dict needs its 'model_type' (as config.json has it, e.g. 'llama')")
        config = transformers.AutoConfig.for_model(**config)
    elif isinstance(config, (str, os.PathLike)):
        config = transformers.AutoConfig.from_pretrained(os.fspath(config), local_files_only=True)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _attention_flops_per_token(model: nn.Module, seq_len: int | None) -> float:
    """The attention scores' and weighted sum's operations a token costs in training (forward and
    backward: 12 * layers * width * seq_len, the term of the PaLM paper's and torchtitan's count),
    where the model has a config that names its layers and width; 0 without ``seq_len``."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    width = getattr(config, "hidden_size", None)
    if not seq_len or layers is None or width is None:
        return 0.0
    return 12.0 * layers * width * seq_len


def model_shape(model, *, units=None, shard_size: int = 1, seq_len: int | None = None) -> ModelShape:
    """``model`` (an ``nn.Module``, best built under ``torch.device("meta")``; or a Hugging Face config:
    a ``PretrainedConfig``, its dict with ``model_type``, or a local folder holding ``config.json``)
    as units, by the unit policy ``units`` (zf.units'; default: each child of every ModuleList)."""
    if not isinstance(model, nn.Module):
        model = _from_config(model)
    spec = tree.build_spec(model, units, world=shard_size)
    shapes = tuple(UnitShape(u.name, u.trainable.numel, len(u.trainable.entries), u.frozen.numel,
                             u.trainable.dtype, u.frozen.dtype) for u in spec.units)
    buffers = tuple(b.numel() * b.element_size() for _, b in model.named_buffers())
    # per token, 2 operations per weight forward and 4 backward (the gradients of the inputs and of
    # the weights), 2 backward for a frozen one; an embedding's weights are looked up, not multiplied
    # (unless tied to an output layer)
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - multiplied
    counted = {}
    for _, p in model.named_parameters():
        if id(p) not in looked_up:
            counted[id(p)] = (p.numel(), p.requires_grad)
    flops = sum((6.0 if trainable else 4.0) * n for n, trainable in counted.values())
    flops += _attention_flops_per_token(model, seq_len)
    return ModelShape(shapes, buffers, flops)
