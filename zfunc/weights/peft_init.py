"""peft's own initialization of a peft model's adapters, run over one unit's adapter modules at a time.

``get_peft_model`` on a model built on the meta device creates each adapter there, so peft's
``reset_*_parameters`` writes nothing; left to transformers' ``_init_weights`` (the adapters sit under
a ``PreTrainedModel``) LoRA's ``lora_B`` would start random where peft starts it at zero. zfunc calls
the tuner layer's own reset instead, with the adapter's config, once the unit's adapter tensors have
storage: LoRA (``init_lora_weights`` True: ``lora_A`` kaiming-uniform, ``lora_B`` zero; "gaussian";
False: ``nn.Linear``'s own init for both; DoRA's magnitude from the base weight, which zfunc reads
before the unit's init) and IA3 (``ia3_l`` ones). Other inits that read the base weights (PiSSA,
OLoRA, ...) or another tuner's raise, naming it and what to do.
"""
from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from .. import compiled


class PeftInit:
    """Which modules are a peft adapter's, and their tuner layer's reset."""

    def __init__(self, model: nn.Module, tuner_cls, layer_cls):
        self.owner: dict[int, tuple[str, nn.Module, str | None]] = {}  # id(module) -> (layer path, layer, adapter)
        self.configs: dict[str, object] = {}  # adapter name -> its peft config
        for path, m in compiled.named_modules(model):
            if isinstance(m, tuner_cls):
                self.configs.update(m.peft_config)
            if isinstance(m, layer_cls):
                for attr in m.adapter_layer_names:
                    container = getattr(m, attr, None)
                    if isinstance(container, nn.ParameterDict):  # owns the tensors: slot name = adapter
                        self.owner[id(container)] = (path, m, None)
                    elif isinstance(container, nn.ModuleDict):
                        for adapter, child in container.items():
                            for sub in child.modules():
                                self.owner[id(sub)] = (path, m, adapter)

    def covers(self, module: nn.Module) -> bool:
        return id(module) in self.owner

    def run(self, modules: list[tuple[nn.Module, list[str]]]) -> list[str]:
        """peft's init of the adapters each ``(module, its tensors' slots)`` holds, each adapter of a
        layer once (its reset writes all of its tensors); the init's name for each."""
        done, ways = set(), []
        for module, slots in modules:
            path, layer, adapter = self.owner[id(module)]
            for name in [adapter] if adapter is not None else slots:
                config = self.configs.get(name)
                if config is None:
                    raise ValueError(f"peft layer {path} ({type(layer).__name__}) holds adapter {name!r}, which no "
                                     "peft config names: add adapters through the peft model (add_adapter)")
                if (id(layer), name) not in done:
                    done.add((id(layer), name))
                    _reset(path, layer, name, config)
            ways.append(f"peft's {type(layer).__name__} init")
        return ways


def _reset(path: str, layer: nn.Module, adapter: str, config) -> None:
    kind = type(layer).__name__
    if hasattr(layer, "reset_lora_parameters") and hasattr(config, "init_lora_weights"):
        init = config.init_lora_weights
        if not (init is True or init is False or init == "gaussian"):
            raise ValueError(
                f"peft layer {path} ({kind}): init_lora_weights={init!r} is computed from the base weights, which zfunc does not "
                "hold while it initializes a meta-built model's adapters: use init_lora_weights True, 'gaussian' "
                "or False, or build the peft model on a real device (get_peft_model on from_pretrained's model)")
        if init is False:  # peft keeps what the adapters' constructors drew
            embeddings = [c for c in ("lora_embedding_A", "lora_embedding_B") if adapter in getattr(layer, c, {})]
            if embeddings:
                raise ValueError(f"peft layer {path} ({kind}): init_lora_weights=False on an embedding keeps "
                                 "peft's constructor draws, which zfunc does not repeat: use True or 'gaussian'")
            for c in ("lora_A", "lora_B"):
                if adapter in getattr(layer, c, {}):
                    getattr(layer, c)[adapter].reset_parameters()
        elif _arguments(layer.reset_lora_parameters) == 1:  # AdaLoRA's takes the adapter only
            layer.reset_lora_parameters(adapter)
        else:
            layer.reset_lora_parameters(adapter, init)
        if adapter in getattr(layer, "lora_magnitude_vector", {}):
            _dora_magnitude(path, layer, adapter)
        return
    if hasattr(layer, "reset_ia3_parameters") and getattr(config, "init_ia3_weights", None) is True:
        layer.reset_ia3_parameters(adapter)
        return
    raise ValueError(
        f"peft layer {path} ({kind}, {type(config).__name__}) was built on the meta device and zfunc knows "
        "peft's init only for LoRA (init_lora_weights True, 'gaussian' or False) and IA3 (init_ia3_weights=True): "
        "build the peft model on a real device (get_peft_model on from_pretrained's model), or pass "
        "step.init(model, init_fn=fn)")


def _dora_magnitude(path: str, layer: nn.Module, adapter: str) -> None:
    """DoRA's magnitude as peft's ``DoraLinearLayer.update_layer`` computes it (the norm of the base weight
    plus the scaled ``lora_B @ lora_A``), into the adapter's own tensor: the base weight is read from the
    files before the unit's init (zfunc.unit_init) where it is in the same unit."""
    base = layer.get_base_layer()
    if base.weight.is_meta or torch.isnan(base.weight).any():
        raise ValueError(f"peft layer {path} ({type(layer).__name__}): DoRA's magnitude is the base weight's norm, "
                         "but the base weight is in another unit or not in the files: put the layer and its "
                         "base in one unit, or build the peft model on a real device")
    magnitude = layer.lora_magnitude_vector[adapter]
    made = type(magnitude)(fan_in_fan_out=getattr(layer, "fan_in_fan_out", False))
    made.update_layer(base_layer=base, lora_A=layer.lora_A[adapter].weight, lora_B=layer.lora_B[adapter].weight,
                      scaling=layer.scaling[adapter])
    magnitude.weight.copy_(made.weight)


def _arguments(method) -> int:
    return len(inspect.signature(method).parameters)


def peft_init(model: nn.Module) -> PeftInit | None:
    """The dispatch for ``model``, or None where it holds no peft tuner layer (peft not imported: nothing is
    imported here)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None or not any(isinstance(m, tuners.BaseTunerLayer) for m in model.modules()):
        return None
    return PeftInit(model, tuners.BaseTuner, tuners.BaseTunerLayer)
