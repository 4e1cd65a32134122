"""Each unit's flat buffers: from a built model, one unit at a time from the meta device, or from files.

A model built on the meta device (``with torch.device("meta"): model = GPT(cfg)``)
holds no weights. Its units are initialized one at a time: the unit's
parameters get real storage, the modules that own them run their own
initialization (below), the unit is laid out flat, and the storage is dropped
again. So the peak memory of init is one unit plus this rank's shards, never
the whole model (DeepSpeed's ``zero.Init``, FSDP2's meta-device init).

With pretrained weights (zfunc.weights) a unit the files hold is not
initialized at all: each rank reads its own part of it, and nothing else.

A module's own initialization is, in this order of precedence:

- ``init_fn(module)`` if the user gave one;
- a peft adapter's tensors (``lora_A``, ``lora_B``, ``ia3_l``): peft's own init of its tuner layer
  (zfunc.weights.peft_init), lora_B zero as ``get_peft_model`` leaves it;
- under a Hugging Face ``PreTrainedModel``: transformers' own, as the model built
  normally gets it in ``post_init`` (zfunc.weights.hf_init: the nearest ``PreTrainedModel``'s
  ``_init_weights`` over the module and those above it, children first), which computes
  buffers too (rotary ``inv_freq``, ``embed_scale``); a tensor the files hold is flagged
  loaded and left, as ``from_pretrained`` leaves it. A tensor ``_init_weights`` does not
  write gets what the module's constructor gave it (``reset_parameters()``);
- else ``reset_parameters()``, else the root model's ``_init_weights(module)``.

A buffer still unset after that, in a module that owns no parameters and keeps its
``config``, is taken from that module built again on the CPU from its config (its
``__init__``'s own computation, e.g. RoPE's ``inv_freq`` in transformers 4). New storage
starts as NaN (floating point), so a tensor the init did not write is found and named,
never left as uninitialized memory.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from . import buffers, compiled
from .weights import hf_init, peft_init
from .tree import ModelSpec, Segment, build_spec


def is_meta_model(model: nn.Module) -> bool:
    """Built on the meta device: its meta parameters are initialized here, any real one (a constructor
    that ignores the device, as DiffLlama's ``torch.normal``) is taken as it is."""
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
    owners = _owning_modules(model, spec) if meta else {}
    init = _Init(model, init_fn)
    for i, unit in enumerate(spec.units):
        segments = (unit.trainable, unit.frozen)
        if weights is not None and all(weights.holds(s) for s in segments):
            yield i, *(weights.read(s, *part(i, s), device) for s in segments), False
            continue
        if meta:
            with _materialized(owners.get(i, []), device, init, weights):
                flats = [_flatten_segment(model, s, device) for s in segments]
        else:
            flats = [_flatten_segment(model, s, device) for s in segments]
        if weights is not None:
            for s, flat in zip(segments, flats):
                weights.fill(s, flat)
        yield i, *flats, True
    _init_buffers(model, device, init, weights)


class ParameterInit:
    """The values the named meta-device parameters of ``model`` get from their modules' own init, as
    ``step.init`` initializes a unit (the module docstring's order of precedence), without making the
    rest of the model (``zero.GatheredParameters`` on a model built inside ``zero.Init``). Built once
    per model (its layout and init dispatch, which cost a walk of the whole model), then called for
    each group of parameters."""

    def __init__(self, model: nn.Module):
        self.model, self.spec, self.init = model, build_spec(model), _Init(model, None)
        self.aliases: dict[str, list] = {}  # canonical name -> [(alias, its module, its slot)]
        for name, _ in compiled.named_parameters(model, remove_duplicate=False):
            canonical = self.spec.canonical_name(name)
            if canonical != name:
                path, _, attr = name.rpartition(".")
                self.aliases.setdefault(canonical, []).append((name, compiled.owner(model, path), attr))

    def __call__(self, names, device="cpu") -> dict[str, torch.Tensor]:
        """New tensors on ``device``, keyed by canonical name. The named parameters stay on the meta
        device; the meta buffers of their modules are made, as init makes them."""
        wanted = {self.spec.canonical_name(n) for n in names}
        owners = []
        for path in dict.fromkeys(n.rpartition(".")[0] for n in sorted(wanted)):
            module = compiled.owner(self.model, path)
            attrs = []
            for attr, p in module._parameters.items():
                name = f"{path}.{attr}" if path else attr
                if p is not None and p.is_meta and self.spec.canonical_name(name) == name:
                    attrs.append((attr, [a for a in self.aliases.get(name, []) if a[1]._parameters[a[2]].is_meta]))
            owners.append((path, module, attrs))
        out = {}
        with _materialized(owners, torch.device(device), self.init, None):
            for path, module, attrs in owners:
                for attr, _ in attrs:
                    name = f"{path}.{attr}" if path else attr
                    if name in wanted:
                        out[name] = module._parameters[attr].detach().clone()
        return out


def _flatten_segment(model: nn.Module, seg: Segment, device) -> torch.Tensor:
    """Copy ``model``'s parameters of ``seg`` into one new zero-padded flat buffer on ``device``."""
    flat = buffers.zeros(seg.padded, seg.dtype, device)
    for e in seg.entries:
        owner, _, attr = e.name.rpartition(".")
        p = compiled.owner(model, owner)._parameters[attr]
        flat[e.offset : e.offset + e.numel].copy_(p.detach().reshape(-1))
    return flat


def _owning_modules(model: nn.Module, spec: ModelSpec) -> dict[int, list]:
    """unit -> [(module path, module, [(slot name, [its tied aliases' (name, module, slot)])])]: the meta
    slots whose name is a parameter's first name (the owner initializes it; an alias's module may too)."""
    out: dict[int, list] = {}
    aliases: dict[int, list] = {}  # id(parameter) -> its other names' (name, module, slot)
    for path, module in compiled.named_modules(model):
        slots: dict[int, list] = {}
        for attr, p in module._parameters.items():
            name = f"{path}.{attr}" if path else attr
            if p is None or not p.is_meta:
                continue
            if spec.canonical_name(name) != name:
                aliases.setdefault(id(p), []).append((name, module, attr))
                continue
            unit, _ = spec.owner_of(name)
            slots.setdefault(unit, []).append((attr, aliases.setdefault(id(p), [])))
        for unit, attrs in slots.items():
            out.setdefault(unit, []).append((path, module, attrs))
    return out


class _materialized:
    """Real storage for a unit's slots while its modules initialize them; meta again after."""

    def __init__(self, owners, device, init: "_Init", weights):
        self.owners, self.device, self.init, self.weights = owners, device, init, weights
        self.saved = []

    def __enter__(self):
        touched, tied = [], []
        with torch.no_grad():
            # a module's real parameters (given values before init: zero.GatheredParameters) are kept,
            # though its init (reset_parameters()) writes all of them
            kept = [(p, p.detach().clone()) for _, module, _ in self.owners for p in module._parameters.values()
                    if p is not None and not p.is_meta]
            for path, module, attrs in self.owners:
                made = []
                for attr, aliases in attrs:
                    p = module._parameters[attr]
                    self.saved.append((module, attr, p))
                    storage = _unset(buffers.empty(p.numel(), p.dtype, self.device).view(p.shape))  # unmapped after
                    module._parameters[attr] = new = nn.Parameter(storage, requires_grad=p.requires_grad)
                    if self.weights is not None and self.weights.holds_tensor(f"{path}.{attr}" if path else attr):
                        hf_init.mark_loaded(new)  # the files' values go over it: no init
                        if self.init.peft is not None:  # peft's inits may read the base (DoRA's magnitude)
                            self.weights.read_tensor(f"{path}.{attr}" if path else attr, new.data)
                        continue
                    made.append(_Made(module, "_parameters", attr, new, self._scratch(p, aliases, tied)))
                made += _materialize_buffers(module, self.device, path, self.weights)
                touched.append((path, module, made))
            try:
                self.init.run(touched, tied)
                for p, value in kept:
                    p.copy_(value)
            except BaseException:
                self.__exit__()
                raise

    def _scratch(self, p: nn.Parameter, aliases, tied: list) -> list[tuple[str, torch.Tensor]]:
        """``(name, storage of its own)`` for each tied alias whose module transformers initializes:
        transformers initializes tied tensors apart and ties them after (``_Init.run`` keeps the
        value of the name its ties point to)."""
        out = []
        for name, m, a in aliases:
            if self.init.is_hf(m):
                self.saved.append((m, a, m._parameters[a]))
                m._parameters[a] = nn.Parameter(_unset(torch.empty(p.shape, dtype=p.dtype, device=self.device)))
                out.append((name, m._parameters[a]))
                tied.append(m)
        return out

    def __exit__(self, *exc):
        for module, attr, p in reversed(self.saved):
            module._parameters[attr] = p


class _Made:
    """A tensor init gave storage to, and how to tell whether the module's init wrote it;
    ``aliases``: its tied aliases' own storage (``_materialized._scratch``)."""

    def __init__(self, module: nn.Module, slots: str, attr: str, tensor: torch.Tensor, aliases=()):
        self.module, self.slots, self.attr = module, slots, attr
        self.tensor, self.version, self.aliases = tensor, tensor._version, aliases

    def now(self) -> torch.Tensor:
        return getattr(self.module, self.slots)[self.attr]

    def unset(self) -> bool:
        """Still as made: NaN anywhere (floating point: storage starts as NaN), else neither written
        nor replaced."""
        now = self.now()
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
            module._buffers[name] = new = _unset(torch.empty(b.shape, dtype=b.dtype, device=device))
            if weights is not None and weights.holds_buffer(f"{path}.{name}" if path else name):
                hf_init.mark_loaded(new)
            else:
                made.append(_Made(module, "_buffers", name, new))
    return made


class _Init:
    """How a meta-built model's modules initialize their tensors (module docstring)."""

    def __init__(self, model: nn.Module, init_fn: Callable | None):
        self.init_fn, self.root = init_fn, compiled.owner(model, "")
        self.hf = None if init_fn is not None else hf_init.hf_init(model)
        self.peft = None if init_fn is not None else peft_init.peft_init(model)

    def is_hf(self, module: nn.Module) -> bool:
        return self.hf is not None and self.hf.covers(module)

    def run(self, touched: list[tuple[str, nn.Module, list[_Made]]], tied: list[nn.Module] = ()) -> None:
        """Initialize the tensors ``made`` of each ``(path, module, made)`` (and the scratch of tied
        aliases, in ``tied``'s modules); raise naming any left unset."""
        touched = [t for t in touched if t[2]]
        adapters = [t for t in touched if self.peft is not None and self.peft.covers(t[1])]
        touched = [t for t in touched if not (self.peft is not None and self.peft.covers(t[1]))]
        hf = [module for _, module, _ in touched if self.is_hf(module)]
        if hf:
            self.hf.run(hf + list(tied))
        for path, module, made in touched:
            if self.is_hf(module):
                way = f"{type(self.hf.hf_of[id(module)]).__name__}._init_weights"
                for m in made:
                    self._tie(m)
                way = _constructor_values(module, made, way)
            else:
                way = self._own_init(path, module, made)
            _check(path, module, made, way)
        if adapters:  # after transformers' pass, which must not be their last word
            ways = self.peft.run([(module, [m.attr for m in made]) for _, module, made in adapters])
            for (path, module, made), way in zip(adapters, ways):
                _check(path, module, made, way)

    def _tie(self, m: "_Made") -> None:
        """The value a tied parameter has once transformers ties it: that of the name its tie keys
        point to (``tie_weights`` sets the others to it); else, where the first name's init left it
        unset (a tie its constructor made), the value an alias's init wrote."""
        source = next((a for name, a in m.aliases if name in self.hf.tie_sources), None)
        written = [a for _, a in m.aliases if not torch.isnan(a).any()]
        if source is not None and not torch.isnan(source).any():
            m.now().copy_(source)
        elif m.unset() and written:
            m.now().copy_(written[0])

    def _own_init(self, path: str, module: nn.Module, made: list[_Made]) -> str:
        if self.init_fn is not None:
            self.init_fn(module)
            return "init_fn"
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
            return "reset_parameters()"
        if callable(getattr(self.root, "_init_weights", None)):
            self.root._init_weights(module)
            return f"{type(self.root).__name__}._init_weights"
        if any(m.slots == "_parameters" for m in made):
            raise ValueError(
                f"module {path or '<root>'} ({type(module).__name__}) was built on the meta device and owns "
                f"{', '.join(m.attr for m in made)}, but has no reset_parameters() to initialize them: pass "
                "step.init(model, init_fn=fn); zfunc calls fn(module) for each module that owns parameters "
                "or buffers, one unit at a time"
            )
        return "nothing (no init_fn, reset_parameters() or _init_weights)"


def _constructor_values(module: nn.Module, made: list[_Made], way: str) -> str:
    """Where ``_init_weights`` left a tensor unset, what the module's constructor gave it before
    ``post_init`` (zfunc.weights.hf_init.constructor_init), the others kept."""
    if not any(m.unset() for m in made):
        return way
    keep = [(m, m.now().clone()) for m in made if not m.unset()]
    if not hf_init.constructor_init(module):
        return way
    for m, value in keep:
        m.now().copy_(value)
    return f"{way} and its constructor's init"


def _check(path: str, module: nn.Module, made: list[_Made], way: str) -> None:
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


def _init_buffers(model: nn.Module, device, init: _Init, weights) -> None:
    """Buffers still on the meta device (modules that own no parameters, or units read from
    files) made by their module's init; then every buffer the files hold read from them."""
    with torch.no_grad():
        init.run([(path, module, _materialize_buffers(module, device, path, weights))
                  for path, module in compiled.named_modules(model)])
        if weights is None:
            return
        for path, module in compiled.named_modules(model):
            for name, b in module._buffers.items():
                full = f"{path}.{name}" if path else name
                if b is not None and weights.holds_buffer(full):
                    weights.read_buffer(full, b)


def device_of_model(model: nn.Module) -> torch.device:
    """Where a built model's parameters are (the CPU for one without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
