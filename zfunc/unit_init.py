"""Each unit's flat buffers: from a built model, one unit at a time from the meta device, or from files.

A model built on the meta device (``with torch.device("meta"): model = GPT(cfg)``)
holds no weights. Its units are initialized one at a time: the unit's
parameters get real storage, the modules that own them run their own
initialization (below), the unit is laid out flat, and the storage is dropped
again. So the peak memory of init is one unit plus this rank's shards, never
the whole model (DeepSpeed's ``zero.Init``, FSDP2's meta-device init).

With pretrained weights (zfunc.weights) a unit the files hold is not
initialized at all: each rank reads its own part of it, and nothing else.

A module's own initialization is ``init_fn(module)`` if the user gave one,
else its ``reset_parameters()``, else the root model's ``_init_weights(module)``
(Hugging Face's per-module init, which also computes rotary embeddings'
frequencies); a buffer still unset after that, in a module that owns no
parameters and keeps its ``config``, is taken from that module built again on
the CPU from its config (its ``__init__``'s own computation, e.g. RoPE's
``inv_freq`` in transformers 4). New storage starts as NaN (floating point), so
a tensor the init did not write is found and named, never left as
uninitialized memory.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from . import buffers, compiled
from .tree import ModelSpec, flatten_segment


def is_meta_model(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def unit_buffers(model: nn.Module, spec: ModelSpec, device, init_fn: Callable | None = None, weights=None,
                 part: Callable | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, bool]]:
    """``(unit, trainable flat, frozen flat, whole)`` for each unit, in unit order.

    ``whole``: the flat buffers are the whole unit, made by every rank (rank 0's values
    count). With ``weights`` (zfunc.weights.Weights), a unit the files hold entirely is read
    instead, only the part ``part(unit, segment) -> (start, stop)`` of each flat buffer
    (``whole`` False); one they hold in part (``strict=False``) is made as without weights,
    then the files' tensors are written over it."""
    meta = is_meta_model(model)
    if meta and any(not p.is_meta for p in model.parameters()):
        raise ValueError("the model mixes meta-device parameters with real ones: build it wholly on the meta device")
    if not meta:
        device = _device_of(model)
    owners = _owning_modules(model, spec) if meta else {}
    root = compiled.owner(model, "")
    for i, unit in enumerate(spec.units):
        segments = (unit.trainable, unit.frozen)
        if weights is not None and all(weights.holds(s) for s in segments):
            yield i, *(weights.read(s, *part(i, s), device) for s in segments), False
            continue
        if meta:
            with _materialized(owners.get(i, []), device, init_fn, root, weights):
                flats = [flatten_segment(model, s, device) for s in segments]
        else:
            flats = [flatten_segment(model, s, device) for s in segments]
        if weights is not None:
            for s, flat in zip(segments, flats):
                weights.fill(s, flat)
        yield i, *flats, True
    _init_buffers(model, device, init_fn, root, weights)


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

    def __init__(self, owners, device, init_fn, root, weights):
        self.owners, self.device, self.init_fn, self.root, self.weights = owners, device, init_fn, root, weights
        self.saved = []

    def __enter__(self):
        with torch.no_grad():
            for path, module, attrs in self.owners:
                made = []
                for attr in attrs:
                    p = module._parameters[attr]
                    self.saved.append((module, attr, p))
                    storage = _unset(buffers.empty(p.numel(), p.dtype, self.device).view(p.shape))  # unmapped after
                    module._parameters[attr] = nn.Parameter(storage, requires_grad=p.requires_grad)
                    made.append(_Made(module, "_parameters", attr, module._parameters[attr]))
                made += _materialize_buffers(module, self.device, path, self.weights)
                _init_module(path, module, self.init_fn, self.root, made)

    def __exit__(self, *exc):
        for module, attr, p in self.saved:
            module._parameters[attr] = p


class _Made:
    """A tensor init gave storage to, and how to tell whether the module's init wrote it."""

    def __init__(self, module: nn.Module, slots: str, attr: str, tensor: torch.Tensor):
        self.module, self.slots, self.attr = module, slots, attr
        self.tensor, self.version = tensor, tensor._version

    def unset(self) -> bool:
        """Still as made: NaN anywhere (floating point: storage starts as NaN), else neither written
        nor replaced."""
        now = getattr(self.module, self.slots)[self.attr]
        if now.is_floating_point():
            return bool(torch.isnan(now).any())
        return now is self.tensor and now._version == self.version


def _unset(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as not yet initialized (NaN), where its dtype can say so."""
    return t.fill_(float("nan")) if t.is_floating_point() else t


def _materialize_buffers(module: nn.Module, device, path: str = "", weights=None) -> list[_Made]:
    """Storage for ``module``'s meta buffers; those its init must fill (not the files' ones)."""
    made = []
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            module._buffers[name] = _unset(torch.empty(b.shape, dtype=b.dtype, device=device))
            if weights is None or not weights.holds_buffer(f"{path}.{name}" if path else name):
                made.append(_Made(module, "_buffers", name, module._buffers[name]))
    return made


def _init_module(path: str, module: nn.Module, init_fn, root: nn.Module, made: list[_Made]) -> None:
    """Run ``module``'s own initialization (module docstring) over the tensors in ``made``;
    raise naming any it left unset."""
    if init_fn is not None:
        way = "init_fn"
        init_fn(module)
    elif hasattr(module, "reset_parameters"):
        way = "reset_parameters()"
        module.reset_parameters()
    elif callable(getattr(root, "_init_weights", None)):
        way = f"{type(root).__name__}._init_weights"
        root._init_weights(module)
    elif any(m.slots == "_parameters" for m in made):
        raise ValueError(
            f"module {path or '<root>'} ({type(module).__name__}) was built on the meta device and owns "
            f"{', '.join(m.attr for m in made)}, but has no reset_parameters() to initialize them: pass "
            "step.init(model, init_fn=fn); zfunc calls fn(module) for each module that owns parameters "
            "or buffers, one unit at a time"
        )
    else:
        way = "nothing (no init_fn, reset_parameters() or _init_weights)"
    unset = [m for m in made if m.unset()]
    if unset and all(m.slots == "_buffers" for m in unset):
        _rebuild_buffers(module, unset)
        unset = [m for m in unset if m.unset()]
    if unset:
        names = ", ".join(f"{path}.{m.attr}" if path else m.attr for m in unset)
        raise ValueError(
            f"{names} of module {path or '<root>'} ({type(module).__name__}) was built on the meta device and "
            f"left uninitialized by {way}: initialize it there (step.init(model, init_fn=fn) calls fn(module) "
            "for each module, one unit at a time), or build the model with its buffers on a real device "
            "(accelerate's init_empty_weights(include_buffers=False))")


def _rebuild_buffers(module: nn.Module, unset: list[_Made]) -> None:
    """The buffers of ``unset`` as ``module``'s ``__init__`` computes them: the module built again
    on the CPU from its ``config`` (Hugging Face's modules keep it), where it owns no parameters
    (so building it costs nothing)."""
    config = getattr(module, "config", None)
    if config is None or next(module.parameters(), None) is not None:
        return
    try:
        with torch.device("cpu"):
            fresh = type(module)(config)
    except Exception:  # a constructor that wants more than its config: the caller names the buffers
        return
    for m in unset:
        value = fresh._buffers.get(m.attr)
        if value is not None and value.shape == m.tensor.shape:
            module._buffers[m.attr].copy_(value)


def _init_buffers(model: nn.Module, device, init_fn, root: nn.Module, weights) -> None:
    """Buffers still on the meta device (modules that own no parameters, or units read from
    files) made by their module's init; then every buffer the files hold read from them."""
    with torch.no_grad():
        for path, module in compiled.named_modules(model):
            made = _materialize_buffers(module, device, path, weights)
            if made:
                _init_module(path, module, init_fn, root, made)
        if weights is None:
            return
        for path, module in compiled.named_modules(model):
            for name, b in module._buffers.items():
                full = f"{path}.{name}" if path else name
                if b is not None and weights.holds_buffer(full):
                    weights.read_buffer(full, b)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
