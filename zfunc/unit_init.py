"""Each unit's flat buffers, from a built model or one unit at a time from the meta device.

A model built on the meta device (``with torch.device("meta"): model = GPT(cfg)``)
holds no weights. Its units are initialized one at a time: the unit's
parameters get real storage, the modules that own them run their own
``reset_parameters()`` (or the user's ``init_fn(module)``), the unit is laid
out flat, and the storage is dropped again. So the peak memory of init is one
unit plus this rank's shards, never the whole model (DeepSpeed's
``zero.Init``, FSDP2's meta-device init).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from . import buffers, compiled
from .tree import ModelSpec, flatten_segment


def is_meta_model(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def unit_buffers(model: nn.Module, spec: ModelSpec, device, init_fn: Callable | None = None
                 ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(unit, trainable flat, frozen flat)`` for each unit, in unit order."""
    if not is_meta_model(model):
        device = _device_of(model)
        for i, unit in enumerate(spec.units):
            yield i, flatten_segment(model, unit.trainable, device), flatten_segment(model, unit.frozen, device)
        return
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("the model mixes meta-device parameters with real ones: build it wholly on the meta device")
    owners = _owning_modules(model, spec)
    for i, unit in enumerate(spec.units):
        with _materialized(owners.get(i, []), device, init_fn):
            trainable = flatten_segment(model, unit.trainable, device)
            frozen = flatten_segment(model, unit.frozen, device)
        yield i, trainable, frozen
    _init_buffers(model, device, init_fn)


def _owning_modules(model: nn.Module, spec: ModelSpec) -> dict[int, list]:
    """unit -> [(module path, module, [slot names it initializes])]: the slots whose
    name is a parameter's first name (a tied alias is initialized by its first owner)."""
    out: dict[int, list] = {}
    for path, module in compiled.named_modules(model):
        slots: dict[int, list[str]] = {}
        for attr, p in module._parameters.items():
            name = f"{path}.{attr}" if path else attr
            if p is None or spec.canonical_name(name) != name:
                continue
            unit, _ = spec.owner_of(name)
            slots.setdefault(unit, []).append(attr)
        for unit, attrs in slots.items():
            out.setdefault(unit, []).append((path, module, attrs))
    return out


class _materialized:
    """Real storage for a unit's slots while its modules initialize them; meta again after."""

    def __init__(self, owners, device, init_fn):
        self.owners, self.device, self.init_fn = owners, device, init_fn
        self.saved = []

    def __enter__(self):
        with torch.no_grad():
            for path, module, attrs in self.owners:
                for attr in attrs:
                    p = module._parameters[attr]
                    self.saved.append((module, attr, p))
                    storage = buffers.empty(p.numel(), p.dtype, self.device).view(p.shape)  # unmapped after
                    module._parameters[attr] = nn.Parameter(storage, requires_grad=p.requires_grad)
                _materialize_buffers(module, self.device)
                _init_module(path, module, self.init_fn, attrs)

    def __exit__(self, *exc):
        for module, attr, p in self.saved:
            module._parameters[attr] = p


def _materialize_buffers(module: nn.Module, device) -> None:
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _init_module(path: str, module: nn.Module, init_fn, attrs) -> None:
    if init_fn is not None:
        init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise ValueError(
            f"module {path or '<root>'} ({type(module).__name__}) was built on the meta device and owns "
            f"{', '.join(attrs)}, but has no reset_parameters() to initialize them: pass "
            "step.init(model, init_fn=fn); zfunc calls fn(module) for each module that owns parameters "
            "or buffers, one unit at a time"
        )


def _init_buffers(model: nn.Module, device, init_fn) -> None:
    """Buffers still on the meta device (modules that own no parameters)."""
    with torch.no_grad():
        for path, module in compiled.named_modules(model):
            meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if meta:
                _materialize_buffers(module, device)
                _init_module(path, module, init_fn, meta)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
