"""DeepSpeed's ``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` for zfunc engines.

``Init`` builds the model on the meta device (torch's device context): nothing is allocated, and
``step.init`` (``zfunc.deepspeed.initialize``) makes each unit from its modules' own init, one unit
at a time, as it makes any meta-built model (zfunc.unit_init). DeepSpeed's arguments that only say
where partitions live or how they are moved change nothing here and are accepted; those that change
the numbers (quantized weights, a low-precision ``dtype`` the config does not train in, tensor
overrides) are refused, named.

``GatheredParameters(params, modifier_rank=)`` gives listed parameters their full values inside
the block, on every rank (every rank enters it, as in DeepSpeed: it is collective):

- after ``initialize``, the model's parameters are stand-ins of the engine's state (zfunc.lazy);
  inside the block they read as the full fp32 values gathered from the engine's current state
  (the master weights under mixed precision), only their units gathered. On exit, with
  ``modifier_rank=r``, rank r's values (after the block's in-place changes) are broadcast and
  written into every copy the state keeps (``zfunc.state.write_params``: the parameters, fp32
  master weights, offload's host copy, swap files); optimizer moments and step counts are kept.
  With ``modifier_rank=None`` changes are discarded.
- before it, a parameter built inside ``Init`` (on the meta device) gets real storage holding its
  module's init (``zfunc.unit_init.ParameterInit``, as ``step.init`` would initialize it); it
  stays real after the block (its init drawn without advancing torch's generator, as DeepSpeed's
  loading path draws nothing), and ``step.init`` takes it as it is (a meta-built model's real
  parameters are kept). With ``modifier_rank=r`` rank r's values are broadcast on exit; with None,
  the values of the block's start are put back. A parameter that already holds data is left alone,
  as DeepSpeed leaves a parameter that is not ZeRO's.

- before it, under an ``Init`` given a ZeRO-3 config (transformers' ``from_pretrained`` under a
  ZeRO-3 config passes one), the values on exit go instead to the model's spill (``Spill``: one
  safetensors file per block, in a folder of this process's) and the parameters become what
  DeepSpeed leaves of partitioned ones (``_placeholder``: 0 elements on the real device, with
  ``ds_shape``, ``ds_numel``, ``ds_id``, ``ds_status``), the block's memory returned to the OS, so a
  module built "like" one of them (transformers' ``resize_token_embeddings``) is real, as under
  DeepSpeed; a later block reads them back, and ``initialize`` (``unspill``) puts them on the meta
  device in their full shapes and reads the spill as pretrained weights, one unit at a time, each
  rank its own bytes, then removes it. Loading a model this way holds one block's tensors, not the
  model.

``register_engine(engine)`` (called by ``zfunc.deepspeed.initialize``) marks the model's stand-ins
with a weak reference to their engine; the engine's state, replaced every step, is read through
the engine at the block's entry and exit.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import shutil
import tempfile
import weakref

import torch
from torch import nn

from .. import buffers, dist, lazy
from ..state import State, check_usable, master_params, unit_values, write_params
from ..unit_init import ParameterInit
from ..weights import hf_init, peft_keys

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_engine", "register_external_parameter",
           "unregister_external_parameter"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's partitioned parameter status (its values), which an engine's ZeRO-3 stand-ins
    carry as ``ds_status``: outside ``GatheredParameters`` they are not available."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3

_ENGINE = "_zfunc_engine"  # the attribute on a stand-in: a weak reference to its engine


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's mark that ``module``'s forward reads ``parameter`` of another module (transformers'
    speech models call it). Nothing to record here: zfunc's coordinator sees every parameter a unit
    reads when it runs (zfunc.coordinator), so a weight read outside its module is gathered where it
    is used without being told. Checked as DeepSpeed checks it."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(f"register_external_parameter: parameter must be an nn.Parameter, got "
                           f"{type(parameter).__name__}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """The undo of ``register_external_parameter``: as there, nothing was recorded."""
    register_external_parameter(module, parameter)


def register_engine(engine) -> None:
    """Mark the parameters of ``engine.model`` (zfunc's stand-ins after ``step.init``) as held by
    ``engine``, so ``GatheredParameters`` finds the engine's state from a parameter."""
    model, state = getattr(engine, "model", None), getattr(engine, "state", None)
    if not isinstance(model, nn.Module) or not isinstance(state, State):
        raise TypeError(f"register_engine takes an engine of zfunc.deepspeed.initialize (with .model and .state), "
                        f"got {type(engine).__name__}")
    _initializer_of.clear()  # the model is the engine's now: nothing to initialize before initialize
    ref = weakref.ref(engine)
    for p in model.parameters():
        if lazy.is_lazy(p):
            setattr(p, _ENGINE, ref)


# ------------------------------------------------------------------ zero.Init

_built: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()  # module -> its parents
_active = 0  # Init blocks open now (nested ones share the hooks)
_hooks: list = []
_spilling: list = []  # per open Init block: whether it was given a ZeRO-3 config (values written go to a spill)
_spill_mode: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules built under such a block


def _parameter_registered(module, name, param):
    _built.setdefault(module, [])
    if any(_spilling):
        _spill_mode.add(module)


def _child_registered(module, name, child):
    if child is not None:
        _built.setdefault(child, []).append(weakref.ref(module))
        _built.setdefault(module, [])
        if any(_spilling):
            _spill_mode.update((module, child))


class Init:
    """``with zfunc.deepspeed.zero.Init(): model = MyModel()``: the model is built on the meta device.

    Accepted and meaningless here (the model holds no data until ``initialize``, whose config and
    process group decide how each unit is sharded, placed and stored): ``module`` (a model built
    already keeps its values; ``step.init`` shards them), ``data_parallel_group``,
    ``sequence_data_parallel_group``, ``zero_param_parallel_group``, ``mpu``,
    ``mem_efficient_linear``, ``remote_device``, ``pin_memory``, ``param_swapper``, and the
    config's placement keys. Refused, since they change the numbers: ``zero_quantized_weights``,
    ``zero_quantized_nontrainable_weights`` (here or in the config), ``tensor_overrides``, and a
    ``dtype`` other than fp32 unless the config trains in it (zfunc stores units in the config's
    ``bf16``/``fp16`` dtype and keeps fp32 master weights made from the fp32 init).
    ``enabled=False`` builds the model normally.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None,
                 tensor_overrides=None):
        self.enabled = enabled
        self.module = module
        cfg = _read_config(config_dict_or_path if config_dict_or_path is not None else config)
        zero = cfg.get("zero_optimization") or {}
        self._spill = zero.get("stage") == 3  # transformers' from_pretrained passes its ZeRO-3 config
        refused = [name for name, on in (
            ("zero_quantized_weights", zero_quantized_weights or zero.get("zero_quantized_weights")),
            ("zero_quantized_nontrainable_weights",
             zero_quantized_nontrainable_weights or zero.get("zero_quantized_nontrainable_weights")),
            ("tensor_overrides", tensor_overrides is not None)) if on]
        if refused:
            raise ValueError(f"zero.Init({', '.join(refused)}): zfunc does not quantize or override the weights a "
                             "model is built with; leave it out (the model is built on the meta device and each unit "
                             "initialized in full precision at initialize)")
        if dtype is not None and dtype != torch.float32 and dtype != _config_dtype(cfg):
            raise ValueError(
                f"zero.Init(dtype={dtype}): zfunc builds the model in fp32 on the meta device and stores each unit in "
                "the dtype of the config's bf16/fp16 block (fp32 master weights from the fp32 init); pass that "
                "config to initialize and leave dtype out (or pass config_dict_or_path= with it enabled)")

    def __enter__(self) -> "Init":
        global _active
        if not self.enabled:
            return self
        self._device = torch.device("meta")
        self._device.__enter__()
        if _active == 0:
            from torch.nn.modules import module as m
            _hooks.append(m.register_module_parameter_registration_hook(_parameter_registered))
            _hooks.append(m.register_module_module_registration_hook(_child_registered))
        _active += 1
        _spilling.append(self._spill)
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if not self.enabled:
            return
        _active -= 1
        _spilling.pop()
        if _active == 0:
            while _hooks:
                _hooks.pop().remove()
        self._device.__exit__(*exc)


def _read_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


def _config_dtype(cfg: dict):
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    if (cfg.get("fp16") or {}).get("enabled"):
        return torch.float16
    return None


def _root_of(p: torch.Tensor) -> nn.Module | None:
    """The outermost module built inside ``Init`` above the module that owns ``p``."""
    owner = next((m for m in list(_built.keys()) if any(q is p for q in m._parameters.values())), None)
    if owner is None:
        return None
    root = owner
    while True:
        parents = [m for m in (r() for r in _built.get(root, [])) if m is not None]
        if not parents:
            return root
        root = parents[0]


_initializer_of: list = []  # [(root, its parameters' names, its ParameterInit)]: the last model's, kept for the next block


def _initializer(root: nn.Module, names: tuple) -> ParameterInit:
    """``root``'s ``ParameterInit``, made again for another model or when its parameters changed
    (one is kept: it holds the model, which a weak map could then never drop; ``register_engine``
    drops it)."""
    if not _initializer_of or _initializer_of[0][0] is not root or _initializer_of[0][1] != names:
        _initializer_of[:] = [(root, names, ParameterInit(root))]
    return _initializer_of[0][2]


def _mark(params, status) -> None:
    for p in params:
        p.ds_status = status


# --------------------------------------------------------------------- the spill


class Spill:
    """The values ``GatheredParameters`` blocks wrote into the parameters of a model built under a
    ZeRO-3 ``Init`` (transformers' ``from_pretrained`` under a ZeRO-3 config), before
    ``initialize``: one safetensors file per block in a folder of this process's, the parameters
    0-element placeholders after each block. ``initialize`` reads the folder as pretrained weights
    (zfunc.weights: each unit in turn, each rank its own bytes) and removes it, so loading holds one
    block's tensors at a time, not the model. A later block over a written parameter reads it back."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="zfunc-zero-init-")
        self.file_of: dict[str, str] = {}  # parameter name -> its newest file
        self._count = 0

    def has(self, name: str) -> bool:
        return name in self.file_of

    def write(self, values: dict[str, torch.Tensor]) -> None:
        import safetensors.torch
        name = f"block-{self._count:06d}.safetensors"
        self._count += 1
        safetensors.torch.save_file({n: v.detach().to("cpu").contiguous() for n, v in values.items()},
                                    os.path.join(self.folder, name))
        self.file_of.update((n, name) for n in values)

    def read(self, names) -> dict[str, torch.Tensor]:
        from safetensors import safe_open
        out = {}
        for n in names:
            with safe_open(os.path.join(self.folder, self.file_of[n]), "pt") as f:
                out[n] = f.get_tensor(n)
        return out

    def weights(self) -> str:
        """The folder as ``weights=`` reads it: an index naming each parameter's newest file (a file
        whose tensors were all written again later is removed)."""
        live = set(self.file_of.values())
        for name in os.listdir(self.folder):
            if name.endswith(".safetensors") and name not in live:
                os.remove(os.path.join(self.folder, name))
        index = {"metadata": {}, "weight_map": dict(sorted(self.file_of.items()))}
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        return self.folder

    def absorb(self, other: "Spill", prefix: str) -> None:
        """Copy ``other``'s newest values in, their names prefixed with ``prefix``, one file at a time."""
        import safetensors.torch
        for name in sorted(set(other.file_of.values())):
            held = safetensors.torch.load_file(os.path.join(other.folder, name))
            self.write({prefix + n: v for n, v in held.items() if other.file_of.get(n) == name})

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


_spills: "weakref.WeakKeyDictionary[nn.Module, Spill]" = weakref.WeakKeyDictionary()  # root -> its spill


def _spill_of(root: nn.Module) -> Spill:
    if root not in _spills:
        spill = _spills[root] = Spill()
        weakref.finalize(root, spill.close)
    return _spills[root]


def spilled(model: nn.Module) -> Spill | None:
    """The spill of ``model`` (or of a model inside it: a peft model over an Init-built base), if any."""
    for m in model.modules():
        if m in _spills:
            return _spills[m]
    return None


def forget_spill(model: nn.Module) -> None:
    """Remove ``model``'s spill (``initialize`` has read it)."""
    for m in model.modules():
        spill = _spills.pop(m, None)
        if spill is not None:
            spill.close()


_ids = iter(range(1 << 62))  # ds_id of the placeholders (DeepSpeed numbers its partitioned parameters)


def _placeholder(p: nn.Parameter) -> None:
    """``p`` as DeepSpeed leaves a partitioned parameter: 0 elements on the real device (the
    group's: the CPU under gloo, the GPU under nccl), in its dtype, with ``ds_shape``, ``ds_numel``,
    ``ds_id`` and ``ds_status`` (NOT_AVAILABLE); the same object in every slot, its attributes kept.
    A module built "like" it (``nn.Embedding(..., device=w.device, dtype=w.dtype)``, as transformers'
    ``resize_token_embeddings`` builds one) is then real, as under DeepSpeed."""
    shape = torch.Size(getattr(p, "ds_shape", None) if is_placeholder(p) else p.shape)
    held = nn.Parameter(torch.empty(0, dtype=p.dtype, device=dist.device_of()), requires_grad=p.requires_grad)
    held.__dict__.update(p.__dict__)
    held.ds_shape, held.ds_numel = shape, shape.numel()
    held.ds_id = p.__dict__.get("ds_id", next(_ids))
    held.ds_status = ZeroParamStatus.NOT_AVAILABLE
    held._zfunc_placeholder = True
    torch.utils.swap_tensors(p, held)


def is_placeholder(p: torch.Tensor) -> bool:
    """Whether ``p`` is a placeholder ``_placeholder`` made (its values in the model's spill or its init)."""
    return p.__dict__.get("_zfunc_placeholder", False) and p.numel() == 0


def _to_meta(p: nn.Parameter, keep_ds: bool = True) -> None:
    """A placeholder on the meta device in its full shape again (what zfunc's init and ``initialize``
    read), the same object; ``keep_ds=False`` drops DeepSpeed's attributes (the engine sets its own)."""
    meta = nn.Parameter(torch.empty(p.ds_shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    meta.__dict__.update(p.__dict__)
    del meta.__dict__["_zfunc_placeholder"]
    if not keep_ds:
        for key in ("ds_shape", "ds_numel", "ds_id", "ds_status"):
            meta.__dict__.pop(key, None)
    torch.utils.swap_tensors(p, meta)


@contextlib.contextmanager
def _as_meta(root: nn.Module):
    """``root``'s placeholders on the meta device in their full shapes inside (zfunc's init reads the
    model's shapes); on exit those still on the meta device are placeholders again."""
    held = [p for p in root.parameters() if is_placeholder(p)]
    for p in held:
        _to_meta(p)
    try:
        yield
    finally:
        for p in held:
            if p.is_meta:
                _placeholder(p)


def _at(root: nn.Module, name: str):
    """What ``root``'s attribute path ``name`` reads now (None if nothing)."""
    path, _, attr = name.rpartition(".")
    try:
        return getattr(root.get_submodule(path), attr, None)
    except AttributeError:
        return None


def unspill(model: nn.Module) -> None:
    """Before ``initialize`` reads ``model``'s spill: every placeholder on the meta device in its full
    shape (DeepSpeed's attributes dropped), and the spill's entries of parameters that hold real data
    now (a module put in a placeholder's place: ``resize_token_embeddings``'s new embedding) dropped,
    so the model's own values are kept for them."""
    roots = [(path, m) for path, m in model.named_modules() if m in _spills]
    for _, root in roots:
        spill = _spills[root]
        keep, moved = {}, {}
        for name, p in root.named_parameters():
            key = p.__dict__.get("_zfunc_spill_name") if is_placeholder(p) or p.is_meta else None
            if key is not None and spill.has(key):
                if key == name or _at(root, key) is p:  # (a peft layer's ``weight`` is its base layer's)
                    keep[key] = spill.file_of[key]
                else:  # its module moved (a resize put another in its place): the spill's key follows it
                    moved[name] = key
                    p._zfunc_spill_name = name
        copies = {name: spill.read([key])[key] for name, key in moved.items()}
        spill.file_of = keep
        if copies:
            spill.write(copies)
    _name_by_model(model, roots)
    for p in model.parameters():
        if is_placeholder(p):
            _to_meta(p, keep_ds=False)


def _name_by_model(model: nn.Module, roots: list[tuple[str, nn.Module]]) -> None:
    """The spills of ``roots`` (the Init-built modules inside ``model``, at their paths) as one spill
    of ``model``'s, by ``model``'s names, where they differ: a module loaded by ``from_pretrained``
    and wrapped in a model of the user's (DeepSpeed-Chat's reward model holds its transformer as
    ``rwtransformer``), or two of them in one model. A peft model's base keeps its own names (the
    weights reader maps peft's names to the base's)."""
    found = peft_keys.tuner(model)
    base = found[1].model if found is not None else None
    if not any(path and root is not base for path, root in roots):
        return
    if base is not None:
        raise ValueError("deepspeed.initialize: the peft model holds modules built under a ZeRO-3 zero.Init "
                         "(from_pretrained under a ZeRO-3 config) outside its base model, which zfunc cannot read "
                         "back; load them without the ZeRO-3 config, or build them inside the base model")
    merged = Spill()
    try:
        for path, root in roots:
            merged.absorb(_spills[root], f"{path}." if path else "")
    except BaseException:  # (a full disk) the spills as they were; the copy removed
        merged.close()
        raise
    for path, root in roots:
        _spills.pop(root).close()
        for p in root.parameters():
            key = p.__dict__.get("_zfunc_spill_name")
            if key is not None:
                p._zfunc_spill_name = (f"{path}." if path else "") + key
    _spills[model] = merged
    weakref.finalize(model, merged.close)


# ------------------------------------------------------- zero.GatheredParameters

_open: set = set()  # (id(engine), name) of stand-ins gathered by an open block


class _Values:
    """The resolver stand-ins read through inside a block (zfunc.lazy): the gathered values of the
    listed parameters; any other stand-in goes to the resolver below, or is refused."""

    def __init__(self, values: dict[str, torch.Tensor], below):
        self.values, self.below = values, below

    def resolve(self, name: str) -> torch.Tensor:
        if name in self.values:
            return self.values[name]
        if self.below is not None:
            return self.below.resolve(name)
        raise RuntimeError(f"parameter {name!r} is held by the engine's state and was not listed in this "
                           "GatheredParameters block: list it there to read it, or run the model through the engine")


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0):`` full values of ``params`` (one parameter or
    an iterable of them) inside the block, on every rank; written back on exit from ``modifier_rank``
    (None: discarded). The module docstring says what happens before and after ``initialize``.

    Every rank of the engine's group must enter the block with the same parameters and
    ``modifier_rank`` (as in DeepSpeed): entry gathers and exit broadcasts. Ranks that pass different
    ones are told so on every rank; a rank that never enters leaves the others waiting in the gather
    until zfunc's collective timeout names it (gloo), as a step would. A block left by an exception
    writes nothing back and issues no collective. ``fwd_module`` is accepted and meaningless: any read
    of a stand-in inside a forward already materializes its unit. ``enabled=False``: a no-op.
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.enabled = enabled
        if not enabled:
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        params = [p for p in params if p is not None]  # a module's absent bias (transformers' lm head), as DeepSpeed skips it
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise TypeError(f"GatheredParameters takes a parameter or an iterable of parameters, got {', '.join(bad)}")
        seen, self.params = set(), []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if modifier_rank is not None and not isinstance(modifier_rank, int):
            raise TypeError(f"GatheredParameters(modifier_rank={modifier_rank!r}): a rank (int) or None")
        self.modifier_rank = modifier_rank
        self._stack = contextlib.ExitStack()

    # ------------------------------------------------------------------ entry

    def __enter__(self):
        if not self.enabled:
            return
        held = [p for p in self.params if lazy.is_lazy(p)]
        meta = [p for p in self.params if not lazy.is_lazy(p) and (p.is_meta or is_placeholder(p))]
        self._engine = self._values = None
        self._built = []
        if held:
            self._gather(held)
        if meta:
            self._materialize(meta)

    def _gather(self, held: list) -> None:
        engines = {id(e): e for e in (self._engine_of(p) for p in held)}
        if len(engines) > 1:
            raise ValueError("GatheredParameters: these parameters belong to models of different engines; gather "
                             "each engine's in a block of its own")
        engine = next(iter(engines.values()))
        window = getattr(engine, "_window", None)  # the imperative style's step in progress (zfunc.engine.imperative)
        if window is not None and window.losses:
            raise RuntimeError("GatheredParameters in the middle of an imperative step (engine.backward since the last "
                               "update): call engine.step() at the accumulation boundary first")
        state = engine.state
        spec = state.params.spec.model
        group = state.params.spec.process_group
        names = sorted({p._zfunc_name for p in held}, key=lambda n: (spec.owner_of(n), n))
        overlap = [n for n in names if (id(engine), n) in _open]
        if overlap:
            raise RuntimeError(f"GatheredParameters: {overlap} already gathered by an enclosing block; nested blocks "
                               "cannot gather a parameter twice (as in DeepSpeed)")
        world = dist.world_size(group)
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise ValueError(f"GatheredParameters(modifier_rank={self.modifier_rank}): the engine's group has ranks "
                             f"0 to {world - 1}")
        if world > 1:
            digest = hashlib.blake2b("|".join(names).encode(), digest_size=7).digest()
            mine = (int.from_bytes(digest, "little"), -1 if self.modifier_rank is None else self.modifier_rank)
            if not dist.same_everywhere(mine, group):
                raise ValueError("GatheredParameters: the ranks entered with different parameters or modifier_rank; "
                                 "every rank must enter the block with the same ones (it gathers and broadcasts)")
        check_usable(state, collective=True)
        device = dist.device_of(group)
        values, units = {}, {}
        for name in names:
            units.setdefault(spec.owner_of(name), []).append(name)
        for (i, trainable), unit_names in sorted(units.items()):
            node = master_params(state) if trainable else state.frozen
            views = node.spec.segment(i).unflatten(unit_values(node, i))
            for name in unit_names:
                values[name] = views[name].to(device=device, dtype=torch.float32, copy=True)
        self._engine, self._values = engine, values
        self._keys = [(id(engine), n) for n in names]
        _open.update(self._keys)
        self._stack.callback(_open.difference_update, self._keys)
        self._stack.enter_context(lazy.resolving(_Values(values, lazy.current())))
        marked = [p for p in held if "ds_status" in p.__dict__]  # DeepSpeed's status, as its clients read it
        for p in marked:
            p.ds_status = ZeroParamStatus.AVAILABLE
        self._stack.callback(_mark, marked, ZeroParamStatus.NOT_AVAILABLE)

    @staticmethod
    def _engine_of(p):
        ref = getattr(p, _ENGINE, None)
        engine = ref() if ref is not None else None
        if engine is None:
            raise ValueError(
                f"GatheredParameters: parameter {p._zfunc_name!r} is held by a zfunc State that no live engine "
                "registered; gather the parameters of a model given to zfunc.deepspeed.initialize (after zf.initialize "
                "or step.init, call zfunc.deepspeed.zero.register_engine(engine), or read zf.gather_params(state))")
        return engine

    def _materialize(self, meta: list) -> None:
        roots = {}
        for p in meta:
            root = _root_of(p)
            if root is None:
                raise ValueError(
                    f"GatheredParameters: a parameter of shape {tuple(p.shape)} is on the meta device but was not built "
                    "inside zfunc.deepspeed.zero.Init, so its module and init are not known: build the model inside "
                    "zero.Init(), or give it real values first")
            roots.setdefault(id(root), (root, []))[1].append(p)
        for root, params in roots.values():
            with _as_meta(root):  # zfunc's init reads the full shapes
                self._materialize_in(root, params)

    def _materialize_in(self, root: nn.Module, params: list) -> None:
        named = list(root.named_parameters())  # first names: what ParameterInit keys by
        name_of = {id(q): n for n, q in named}
        names = [name_of[id(p)] for p in params]
        spill = _spills.get(root)
        keys = {n: p.__dict__.get("_zfunc_spill_name", n) for p, n in zip(params, names)}  # where each was spilled
        held = [n for n in names if spill is not None and spill.has(keys[n])]
        written = {n: spill.read([keys[n]])[keys[n]] for n in held}
        fresh = [n for n in names if n not in written]
        values = dict(written)
        if fresh:  # drawn without moving torch's generator: DeepSpeed's loading path draws nothing either
            with torch.random.fork_rng(devices=[]):
                values.update(_initializer(root, tuple(n for n, _ in named))(fresh, device="cpu"))
        for p, name in zip(params, names):
            real = nn.Parameter(values[name], requires_grad=p.requires_grad)
            real.__dict__.update(p.__dict__)  # swap_tensors swaps the attributes too: keep the slot's own
            torch.utils.swap_tensors(p, real)  # the same object, now holding data, in every slot
            hf_init.mark_loaded(p)  # transformers' init (a parent's, at initialize) leaves it, as a loaded one
            if "ds_status" in p.__dict__:
                p.ds_status = ZeroParamStatus.AVAILABLE
            self._built.append((p, p.detach().clone(), root, name))

    # ------------------------------------------------------------------- exit

    def __exit__(self, exc_type, *exc):
        if not self.enabled:
            return
        try:
            self._stack.close()  # the stand-ins refuse reads again
            if exc_type is not None:
                return
            if self._values is not None and self.modifier_rank is not None:
                state = self._engine.state
                group = state.params.spec.process_group
                for value in self._values.values():  # in the sorted order every rank agreed on
                    dist.broadcast(value, self.modifier_rank, group)
                write_params(state, self._values)
            written: dict = {}
            for p, before, root, name in self._built:
                with torch.no_grad():
                    if self.modifier_rank is None:
                        p.copy_(before)
                    elif dist.world_size() > 1:
                        dist.broadcast(p.data, self.modifier_rank)
                written.setdefault(root, {})[name] = p
            for root, params in written.items():  # under a ZeRO-3 Init: to the model's spill, placeholders again
                if root not in _spill_mode:
                    continue
                if self.modifier_rank is not None:
                    _spill_of(root).write({name: p.detach() for name, p in params.items()})
                    for name, p in params.items():
                        p._zfunc_spill_name = name  # its name may change (a module replaced): the spill's key stays
                for p in params.values():
                    _placeholder(p)
                buffers.trim()  # the block's memory back to the OS: loading holds one block, not the model
        finally:
            self._values = self._engine = None
            self._built = []

