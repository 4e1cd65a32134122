"""A peft model's tensor names mapped onto its base model's, so a base model's own folder loads it.

``peft.get_peft_model(model, config)`` wraps ``model`` in place: its names gain the tuner's prefix
(``base_model.model.`` under a ``PeftModel``), a wrapped layer keeps its original module as
``base_layer`` (``q_proj.weight`` becomes ``q_proj.base_layer.weight``), and a module listed in
``modules_to_save`` becomes ``original_module`` plus a trainable copy per adapter
(``modules_to_save.<adapter>``) that starts as the original. The adapters' own tensors
(``lora_A``, ``lora_B``, ``ia3_l``, ...: whatever a tuner layer holds outside its ``base_layer``)
are in no base folder: peft initializes them.

The rules follow the module tree, not names: under a ``BaseTunerLayer`` only ``base_layer`` leads to
base tensors; under an ``AuxiliaryTrainingWrapper`` both ``original_module`` and each
``modules_to_save`` copy are the wrapped module. Nothing is imported here: a peft model means peft is.
"""
from __future__ import annotations

import sys

from torch import nn

from .. import compiled


def _peft():
    """peft's tuner and wrapper classes, or None where peft is not imported."""
    tuners, other = sys.modules.get("peft.tuners.tuners_utils"), sys.modules.get("peft.utils.other")
    if tuners is None:
        return None
    wrapper = getattr(other, "AuxiliaryTrainingWrapper", None) if other is not None else None
    return tuners.BaseTuner, tuners.BaseTunerLayer, wrapper


def tuner(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(path, tuner)``: the peft ``BaseTuner`` (``LoraModel``, ``IA3Model``, ...) in ``model``, or None."""
    classes = _peft()
    if classes is None:
        return None
    found = [(path, m) for path, m in compiled.named_modules(model) if isinstance(m, classes[0])]
    if len(found) > 1:
        raise ValueError(f"weights: the model holds {len(found)} peft tuners ({', '.join(p for p, _ in found)}): "
                         "zfunc loads a base folder into one; wrap the base model with peft once")
    return found[0] if found else None


def base_model(model: nn.Module) -> nn.Module:
    """The model peft wrapped (the tuner's ``model``): its class names the folder's layout."""
    return tuner(model)[1].model


def base_names(model: nn.Module, keys) -> dict[str, str | None] | None:
    """Each of ``keys`` (the model's state_dict names) -> its name in the base model's files, or None
    for an adapter's own tensor; None where ``model`` is not a peft model."""
    found = tuner(model)
    if found is None:
        return None
    path, peft_tuner = found
    prefix = f"{path}.model." if path else "model."
    _, layer_cls, wrapper_cls = _peft()
    out: dict[str, str | None] = {}
    for key in keys:
        if not key.startswith(prefix):
            raise ValueError(f"weights: tensor {key!r} is outside the peft tuner's base model ({prefix!r}): "
                             "zfunc reads a peft model's base tensors from its base model's folder only")
        out[key] = _base_name(peft_tuner.model, key[len(prefix):].split("."), layer_cls, wrapper_cls)
    return out


def _base_name(module: nn.Module, parts: list[str], layer_cls, wrapper_cls) -> str | None:
    kept, i = [], 0
    while i < len(parts) - 1:
        part = parts[i]
        if wrapper_cls is not None and isinstance(module, wrapper_cls):
            if part == "original_module":
                module, i = module.original_module, i + 1
                continue
            if part == "modules_to_save":  # a trainable copy per adapter, made from the original
                module, i = module.modules_to_save[parts[i + 1]], i + 2
                continue
            if isinstance(module._modules[part], layer_cls):  # trainable tokens: a tuner layer over the original
                module, i = module._modules[part], i + 1
                continue
        elif isinstance(module, layer_cls):
            if part != "base_layer":
                return None  # the tuner layer's own: an adapter tensor
            module, i = module.base_layer, i + 1
            continue
        kept.append(part)
        module, i = module._modules[part], i + 1
    if isinstance(module, layer_cls) and not (wrapper_cls is not None and isinstance(module, wrapper_cls)):
        return None  # a tensor the tuner layer owns directly
    return ".".join(kept + parts[-1:])


def adapter_file_names(model: nn.Module, keys) -> dict[str, str]:
    """Each of ``keys`` that an adapter folder holds (an adapter's tensor, a ``modules_to_save`` copy) ->
    its name in the ``adapter_model.safetensors`` that ``PeftModel.save_pretrained`` writes: the key
    without its adapter's name (``lora_A.default.weight`` is ``lora_A.weight`` there; a wrapper's copy
    is named as its ``adapter_state_dict_load_map`` says)."""
    found = tuner(model)
    path, peft_tuner = found
    prefix = f"{path}.model." if path else "model."
    _, layer_cls, wrapper_cls = _peft()
    out = {}
    for key in keys:
        parts = key[len(prefix):].split(".")
        module, i = peft_tuner.model, 0
        while i < len(parts) - 1:
            part = parts[i]
            child = module._modules.get(part)
            if wrapper_cls is not None and isinstance(module, wrapper_cls):  # peft's own map of its saved names
                saved = {loaded: name for adapter in peft_tuner.peft_config
                         for name, loaded in module.adapter_state_dict_load_map(adapter).items()}
                rest = ".".join(parts[i:])
                if rest in saved:
                    out[key] = ".".join([prefix.rstrip("."), *parts[:i], saved[rest]])
                    break
            if isinstance(module, layer_cls) and part != "base_layer" and part in module.adapter_layer_names:
                adapter = parts[i + 1] if isinstance(child, (nn.ModuleDict, nn.ParameterDict)) else None
                if adapter is not None:
                    out[key] = ".".join([prefix.rstrip("."), *parts[: i + 1], *parts[i + 2 :]])
                break
            if child is None:
                break
            module, i = child, i + 1
    return out

