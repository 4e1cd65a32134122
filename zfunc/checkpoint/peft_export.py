"""What a peft model's state is written as: its adapters, as peft saves them, or the model with them merged.

``save_hf(state, DIR, model=peft_model)`` writes what ``PeftModel.save_pretrained(DIR)`` writes: for
each adapter (``selected_adapters``, all by default; ``default`` in ``DIR``, another in ``DIR/<name>``)
``adapter_model.safetensors`` and ``adapter_config.json``. Which tensors, and under which names, is
peft's own ``get_peft_model_state_dict``: it is handed the state's names with a stand-in per tensor
(meta tensors, no values), and the stand-ins it returns say which of the state's tensors to gather.
So every tuner's rules hold (LoRA's ``bias``, DoRA's magnitude name, ``modules_to_save`` copies,
embedding layers) without zfunc repeating them. Only the units holding such tensors are gathered,
and only the part (trainable or frozen) holding them.

``merged=True`` writes what ``save_pretrained`` writes for ``merge_and_unload()``'s model: the walk of
peft's ``_unload_and_optionally_merge`` over the module tree (a tuner layer replaced by its base
layer, a ``modules_to_save`` wrapper by its active copy) names each tensor as the base model does,
and peft's own ``merge`` computes each merged weight, unit by unit: the unit is gathered, copies of
its tensors stand in the model's modules while peft's merge runs on them, and the model is left as
it was. A layer whose tensors lie in two units is refused, naming it.

This module says what goes in; ``hf_export`` writes it (atomically, rank 0, as the model folders).
"""
from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from .. import compiled
from ..state import master_params, unit_values
from ..weights.peft_keys import tuner
from .hf_files import Planned

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # a PeftModel's names: PeftModel.base_model (the tuner) .model (the base)


def is_peft(model: nn.Module | None) -> bool:
    return model is not None and tuner(model) is not None


def looks_like_peft(names) -> bool:
    """Whether a state's parameter names are a ``PeftModel``'s (all under ``base_model.model.``)."""
    names = list(names)
    return bool(names) and all(n.startswith(_PEFT_PREFIX) for n in names)


def check_peft_model(model: nn.Module) -> None:
    """``model`` is a ``PeftModel`` whose adapters peft can save (a tuner, not prompt learning)."""
    if not hasattr(model, "peft_config") or not hasattr(model, "base_model"):
        raise TypeError(f"save_hf(model=...): {type(model).__name__} holds a peft tuner but is not a PeftModel; "
                        "pass the model peft.get_peft_model returned (the one step.init took)")


@dataclass
class AdapterFolder:
    """One adapter as ``PeftModel.save_pretrained`` writes it: in ``subfolder`` of the save's folder
    ("" for ``default``), ``plan``'s tensors (from ``values()``, every rank) and ``config_text``."""

    adapter: str
    subfolder: str
    plan: list[Planned]
    config_text: str
    values: Callable[[], Iterator[tuple[str, torch.Tensor]]]


def adapter_folders(state, model: nn.Module, selected_adapters=None, save_embedding_layers="auto",
                    dtype: torch.dtype | None = None) -> list[AdapterFolder]:
    """The adapters of peft model ``model`` (the one ``state`` was built from) as peft saves them."""
    from peft.utils import get_peft_model_state_dict

    check_peft_model(model)
    names = list(model.peft_config)
    selected = names if selected_adapters is None else list(selected_adapters)
    unknown = [a for a in selected if a not in names]
    if unknown or not selected:
        raise ValueError(f"selected_adapters={selected_adapters!r}: the model's adapters are {names}; name some of them")
    stand_ins, source, kinds = _stand_ins(state)
    out = []
    for adapter in selected:
        with _standing_in(model, {source[id(t)]: t for t in stand_ins.values()}):  # peft reads modules' keys
            saved = get_peft_model_state_dict(model, state_dict=dict(stand_ins), adapter_name=adapter,
                                              save_embedding_layers=save_embedding_layers)
        wanted = {}
        for name, t in saved.items():
            if id(t) not in source:
                raise ValueError(f"peft's state dict of adapter {adapter!r} holds {name!r}, which it computed rather "
                                 "than took from the model's tensors: zfunc saves only tensors the state holds; save "
                                 "this adapter with peft from a model in memory (zf.gather_params)")
            wanted[name] = source[id(t)]
        plan = [Planned(name, tuple(stand_ins[src].shape), _dtype(kinds[src], dtype)) for name, src in wanted.items()]
        out.append(AdapterFolder(adapter, "" if adapter == "default" else adapter, _in_order(plan, wanted, state),
                                 _config_text(model, adapter), _values_of(state, wanted, {t.name: t.dtype for t in plan})))
    return out


def merged_model(state, model: nn.Module, dtype: torch.dtype | None = None):
    """``(plan, parameter elements per dtype, values, the base model's config)`` of ``model``'s
    ``merge_and_unload()``: every rank runs through ``values`` (its gathers are collectives)."""
    check_peft_model(model)
    _, found = tuner(model)
    if hasattr(found, "_check_merge_allowed"):
        found._check_merge_allowed()  # peft's own refusals (layer replication, quantized bases, ...)
    spec = state.params.spec.model
    trainable = master_params(state)
    first = {id(p): n for n, p in compiled.named_parameters(model)}
    buffer_names = {id(b): n for n, b in compiled.named_buffers(model)}
    params, buffers, merges = _unloaded(found.model)
    owners = {}  # param name -> (unit, the params of its part)
    for i in range(len(spec.units)):
        for part in (trainable, state.frozen):
            for e in part.spec.segment(i).entries:
                owners[e.name] = (i, part)
    points: dict[int, list[nn.Module]] = {}
    for path, point in merges:
        units = {owners[first[id(p)]][0] for p in point.parameters()}
        if len(units) > 1:
            raise ValueError(f"merged=True: peft layer {path or '(root)'} ({type(point).__name__}) has tensors in units "
                             f"{sorted(units)}, and zfunc merges one unit at a time: put the layer in one unit (zero3's "
                             "units=), or save the adapter (merged=False) and merge it with peft")
        if units:
            points.setdefault(units.pop(), []).append(point)
    plan, parameters, by_unit = [], Counter(), {}
    for name, module, leaf, p in params:
        source = first[id(p)]
        unit, part = owners[source]
        segment = part.spec.segment(unit)
        t = Planned(name, next(e.shape for e in segment.entries if e.name == source), _dtype(segment.dtype, dtype))
        by_unit.setdefault(unit, []).append((t, module, leaf))
        parameters[t.dtype] += math.prod(t.shape)
    for unit in sorted(by_unit):
        plan += [t for t, _, _ in by_unit[unit]]
    transient = set(spec.transient_buffers)
    kept = [(name, buffer_names[id(b)]) for name, b in buffers if buffer_names.get(id(b)) not in transient]
    for name, source in kept:
        b = state.buffers[source]
        plan.append(Planned(name, tuple(b.shape), _dtype(b.dtype, dtype)))
    dtypes = {t.name: t.dtype for t in plan}

    def values():
        layers = [m for _, m in compiled.named_modules(model) if hasattr(m, "merged_adapters")]
        saved = [(m, list(m.merged_adapters), dict(getattr(m, "_caches", {}))) for m in layers]
        try:
            for unit in sorted(set(by_unit) | set(points)):
                copies = {}
                for part in (trainable, state.frozen):
                    if part.spec.segment(unit).entries:
                        for name, v in part.spec.segment(unit).unflatten(unit_values(part, unit)).items():
                            copies[name] = nn.Parameter(v.to("cpu", part.spec.segment(unit).dtype, copy=True),
                                                        requires_grad=False)
                with _standing_in(model, copies):
                    with torch.no_grad():
                        for point in points.get(unit, ()):
                            _merge(point)
                    for t, m, leaf in by_unit.get(unit, ()):
                        yield t.name, m._parameters[leaf].detach().to("cpu", dtypes[t.name])
                del copies
        finally:
            for m, merged, caches in saved:
                m.merged_adapters[:] = merged
                if hasattr(m, "_caches"):
                    m._caches.clear()
                    m._caches.update(caches)
        for name, source in kept:
            yield name, state.buffers[source].to("cpu", dtypes[name])

    return plan, parameters, values(), getattr(found.model, "config", None)


def _unloaded(base: nn.Module):
    """The tree ``merge_and_unload`` leaves, walked as peft's ``_unload_and_optionally_merge`` walks it:
    ``(params as (name, module, slot, parameter), persistent buffers, merge points)``, each tensor once
    under its first name. The slot is where the merged value is read: peft's merge writes it there."""
    params, buffers, merges, seen = [], [], [], set()

    def walk(module: nn.Module, path: str, merging: bool) -> None:
        if merging and hasattr(module, "unload_and_optionally_merge_module"):
            merges.append((path, module))
            inner = module.unload_and_optionally_merge_module(merge=False, safe_merge=False, adapter_names=None)
            return walk(inner, path, False)
        if merging and hasattr(module, "base_layer"):
            merges.append((path, module))
            return walk(module.get_base_layer(), path, False)
        for leaf, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append((f"{path}.{leaf}" if path else leaf, module, leaf, p))
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                buffers.append((f"{path}.{leaf}" if path else leaf, b))
        for leaf, child in module._modules.items():
            if child is not None:
                walk(child, f"{path}.{leaf}" if path else leaf, merging)

    walk(base, "", True)
    return params, buffers, merges


def _merge(point: nn.Module) -> None:
    """peft's own merge of one point, as ``_unload_and_optionally_merge`` runs it (active adapters)."""
    if hasattr(point, "unload_and_optionally_merge_module"):
        point.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
    else:
        point.merge(safe_merge=False, adapter_names=None)


@contextmanager
def _standing_in(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """``tensors`` (by first name: parameters, buffers) in every slot of ``model`` holding them, tied slots
    included, for the block; the model's own (held by the state) back after it."""
    first = {id(p): n for n, p in compiled.named_parameters(model)}
    first.update({id(b): n for n, b in compiled.named_buffers(model)})
    installed = []
    try:
        for _, m in compiled.named_modules(model):
            for slots in (m._parameters, m._buffers):
                for leaf, held in list(slots.items()):
                    name = first.get(id(held)) if held is not None else None
                    if name in tensors:
                        installed.append((slots, leaf, held))
                        slots[leaf] = tensors[name]
        yield
    finally:
        for slots, leaf, held in reversed(installed):
            slots[leaf] = held


def _dtype(held: torch.dtype, asked: torch.dtype | None) -> torch.dtype:
    return held if asked is None or not held.is_floating_point else asked


def _stand_ins(state):
    """``(name -> a meta tensor per tensor of the state (tied names share one), id -> its first name,
    first name -> its dtype)``: a state dict peft can select from without a value in it."""
    spec = state.params.spec.model
    trainable = master_params(state)
    held, kinds = {}, {}
    for i in range(len(spec.units)):
        for part in (trainable, state.frozen):
            segment = part.spec.segment(i)
            for e in segment.entries:
                held[e.name] = nn.Parameter(torch.empty(e.shape, dtype=segment.dtype, device="meta"),
                                            requires_grad=False)
                kinds[e.name] = segment.dtype
    stand_ins = {name: held[spec.canonical_name(name)] for name, _ in spec.owner}
    transient = set(spec.transient_buffers)
    for name, b in state.buffers.items():
        if name not in transient:
            stand_ins[name] = held[name] = torch.empty(tuple(b.shape), dtype=b.dtype, device="meta")
            kinds[name] = b.dtype
    return stand_ins, {id(t): name for name, t in held.items()}, kinds


def _in_order(plan: list[Planned], wanted: dict[str, str], state) -> list[Planned]:
    """``plan`` in the order ``_values_of`` yields it (unit by unit, then buffers)."""
    rank = {name: k for k, name in enumerate(_order(state))}
    return sorted(plan, key=lambda t: rank[wanted[t.name]])


def _order(state) -> list[str]:
    spec, trainable = state.params.spec.model, master_params(state)
    names = [e.name for i in range(len(spec.units)) for part in (trainable, state.frozen)
             for e in part.spec.segment(i).entries]
    return names + list(state.buffers)


def _values_of(state, wanted: dict[str, str], dtypes: dict[str, torch.dtype]):
    """``values()``: each saved name's tensor, gathering only the units (and their part) holding one."""

    def values():
        spec, trainable = state.params.spec.model, master_params(state)
        by_source: dict[str, list[str]] = {}
        for name, source in wanted.items():
            by_source.setdefault(source, []).append(name)
        for i in range(len(spec.units)):
            for part in (trainable, state.frozen):
                segment = part.spec.segment(i)
                if any(e.name in by_source for e in segment.entries):
                    views = segment.unflatten(unit_values(part, i))
                    for source in [e.name for e in segment.entries if e.name in by_source]:
                        for name in by_source[source]:
                            yield name, views[source].to("cpu", dtypes[name], copy=True)
                    del views
        for source, b in state.buffers.items():
            for name in by_source.get(source, ()):
                yield name, b.to("cpu", dtypes[name], copy=True)

    return values


def _config_text(model: nn.Module, adapter: str) -> str:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (its base model's name filled in,
    ``inference_mode`` true, the auto mapping where the config names no task), by peft's own writer; the
    model's config is left as it was."""
    config = copy.deepcopy(model.peft_config[adapter])
    if config.base_model_name_or_path is None:
        base = model.base_model if config.is_prompt_learning else model.base_model.model
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto = None
    if config.task_type is None:
        cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder, auto_mapping_dict=auto)
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            text = f.read()
    json.loads(text)  # peft wrote it: a check that it is whole
    return text
