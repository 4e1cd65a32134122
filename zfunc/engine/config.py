"""A DeepSpeed-style JSON config, parsed and checked into plain data.

``parse(config, world_size)`` reads a dict or a JSON file and returns a frozen
:class:`Config`; nothing is built and nothing warns. Every key is accounted for:

* keys zfunc acts on become fields, with DeepSpeed 0.19's defaults (each checked
  against the installed package's ``deepspeed/runtime`` sources; see the tests);
* keys that only tune DeepSpeed's own implementation or tooling are accepted and
  listed, as dotted paths, in ``Config.ignored`` (:func:`warn_ignored` says so once);
* keys for features zfunc lacks raise "not supported yet", naming the key (a
  semantic switch left at DeepSpeed's default, or a feature section with
  ``"enabled": false``, is accepted: it changes nothing);
* a top-level key written as a path (``"zero_optimization.reduce_bucket_size"``, which TRL's
  ``prepare_deepspeed`` passes) is listed in ``Config.ignored``: DeepSpeed reads only the nested
  key, so it acts on none of them either;
* any other key raises, naming its dotted path and the nearest valid key there.

As in DeepSpeed, ``"auto"`` in the ``zero_optimization``, offload, ``fp16`` and
``bf16`` sections means the default (DeepSpeed's config models drop such values);
anywhere else it is an error, as it would be in DeepSpeed.
"""
from __future__ import annotations

import copy
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..optim import lr as lr_schedules
from ..ops._names import nearest, unknown

# ----------------------------------------------------------------------- the records


@dataclass(frozen=True)
class OptimizerConfig:
    """The ``optimizer`` section. ``type`` is ``"adam"``, ``"adamw"``, ``"sgd"`` or ``"muon"``.

    ``decoupled`` is the weight decay DeepSpeed actually applies: True is AdamW's
    (on the weights), False is L2 (added to the gradient). DeepSpeed's ``"Adam"``
    is AdamW unless ``adam_w_mode`` is false; ``"AdamW"`` always is. The default
    ``weight_decay`` is DeepSpeed's: 0 (its FusedAdam / CPU Adam), or 0.01 when
    ``torch_adam`` picks ``torch.optim.AdamW``. ``torch_adam`` and ``fused`` are
    recorded, not acted on.

    ``"muon"`` is DeepSpeed's Muon: ``zf.optim.muon`` (``momentum``, ``nesterov``, ``ns_steps``,
    ``adjust_lr_fn``) on the parameters DeepSpeed gives it (``use_muon``, else every 2-D parameter),
    AdamW (``betas``, ``eps``) on the rest, both with ``lr`` and ``weight_decay``.
    """

    type: str
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    torch_adam: bool = False
    fused: bool | None = None
    ns_steps: int = 5
    adjust_lr_fn: str | None = None


@dataclass(frozen=True)
class FP16Config:
    """The ``fp16`` section; ``loss_scale`` 0 means dynamic loss scaling starting at
    ``2 ** initial_scale_power``."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: int = 1
    consecutive_hysteresis: bool = False

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    """The ``bf16`` (legacy ``bfloat16``) section. ``check_grad_overflow``: DeepSpeed
    skips a step whose gradients hold inf/NaN (its default, True)."""

    enabled: bool = False
    check_grad_overflow: bool = True


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param``; ``device`` is ``"none"``, ``"cpu"``
    (``zf.offload_cpu(params=True)``) or ``"nvme"``; the buffer fields are NVMe's."""

    device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    pin_memory: bool = True
    max_in_cpu: int = 1_000_000_000


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``; ``device`` is ``"none"``, ``"cpu"`` or ``"nvme"``."""

    device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``. An offload section that is absent is None."""

    stage: int = 0
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    # MiCS: all states sharded over groups of this many consecutive ranks, replicated across them
    # (-1: off); zfunc's hybrid sharding, zero's mesh=zf.dist.mesh(shard=mics_shard_size)
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False  # accepted: it only routes MiCS's gathers
    zero_hpz_partition_size: int = 1  # ZeRO++'s hpZ: zero3's reshard_after_forward=k where k > 1


@dataclass(frozen=True)
class CompileConfig:
    """The ``compile`` section. ``deepcompile`` is DeepSpeed 0.19's key: the whole step
    compiled as one program (``zf.jit``). ``enabled``, ``backend`` and ``kwargs`` are the
    keys of DeepSpeed's first ``compile`` section (2024; later releases moved them to
    ``engine.compile(backend, compile_kwargs)`` and reject them): ``enabled`` compiles the
    model's blocks at initialize (``zf.compile_units``) with ``torch.compile``'s ``backend``
    and keyword arguments ``kwargs``; under ``deepcompile`` they are ``zf.jit``'s."""

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict = field(default_factory=dict)
    deepcompile: bool = False

    @property
    def on(self) -> bool:
        """Whether the section compiles anything."""
        return self.enabled or self.deepcompile


@dataclass(frozen=True)
class Config:
    """A parsed DeepSpeed config (see the module docstring).

    ``train_batch_size == micro_batch_size * gradient_accumulation_steps *
    world_size`` always holds. ``gradient_clipping`` defaults to DeepSpeed 0.19's
    1.0 (``GRADIENT_CLIPPING_DEFAULT``): a config without the key clips at norm 1;
    0 turns clipping off. ``steps_per_print`` defaults to DeepSpeed 0.19's None
    (no progress lines). A section that is absent is None (``zero`` is always a
    record: stage 0 by default). ``raw`` is a copy of the input.
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    optimizer: OptimizerConfig | None
    scheduler: dict | None
    fp16: FP16Config | None
    bf16: BF16Config | None
    gradient_clipping: float
    zero: ZeroConfig
    aio: dict | None
    steps_per_print: int | None
    wall_clock_breakdown: bool
    ignored: tuple[str, ...]
    raw: dict
    compile: CompileConfig | None = None

    @property
    def compute_dtype(self):
        """``torch.float16`` / ``torch.bfloat16`` when fp16 / bf16 is enabled, else None."""
        import torch

        if self.fp16 is not None and self.fp16.enabled:
            return torch.float16
        if self.bf16 is not None and self.bf16.enabled:
            return torch.bfloat16
        return None

    # The config as DeepSpeed's engine keeps it (``engine.config``, a dict): clients read its keys
    # (transformers' Trainer: ``engine.config.get("zero_optimization", {})``).

    def get(self, key, default=None):
        return self.raw.get(key, default)

    def __getitem__(self, key):
        return self.raw[key]

    def __contains__(self, key) -> bool:
        return key in self.raw

    def keys(self):
        return self.raw.keys()


# ---------------------------------------------------------------------- entry points


def parse(config: Mapping[str, Any] | str | os.PathLike, world_size: int) -> Config:
    """Read and check ``config`` (a dict, or the path of a JSON file) for
    ``world_size`` data-parallel ranks. Raises ValueError naming the key on any
    problem (FileNotFoundError for a missing file)."""
    raw = _load(config)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    ignored: list[str] = []
    top = _Section(raw, "", ignored)
    top.ignore(*[k for k in raw if "." in k])  # a path as a top-level key: DeepSpeed reads none (TRL passes some)
    tbs, mbs, gas = _batch(top, world_size)
    optimizer = _optimizer(top.sub("optimizer"), ignored)
    scheduler = top.sub("scheduler", raw=True)
    if scheduler is not None:
        lr_schedules.validate(scheduler, "scheduler")
        scheduler = copy.deepcopy(dict(scheduler))
    fp16, bf16 = _precision(top, ignored)
    clip = top.get("gradient_clipping", "float", 1.0, lo=0.0)
    zero = _zero(top.sub("zero_optimization", auto_is_default=True))
    aio = _aio(top.sub("aio"))
    steps_per_print = _steps_per_print(top)
    wall_clock = top.get("wall_clock_breakdown", "bool", False)
    compile_ = _compile(top.sub("compile", auto_is_default=True), ignored)
    _top_level_rest(top)
    top.finish()
    return Config(
        train_batch_size=tbs, micro_batch_size=mbs, gradient_accumulation_steps=gas, world_size=world_size,
        optimizer=optimizer, scheduler=scheduler, fp16=fp16, bf16=bf16, gradient_clipping=clip, zero=zero,
        aio=aio, steps_per_print=steps_per_print, wall_clock_breakdown=wall_clock, ignored=tuple(ignored),
        raw=raw, compile=compile_,
    )


def _steps_per_print(top) -> int | None:
    """``steps_per_print``; ``inf`` (what accelerate writes for the Trainer) is never, as None."""
    value = top.data.get("steps_per_print")
    if isinstance(value, float) and value == float("inf"):
        top.known.append("steps_per_print")
        return None
    return top.get("steps_per_print", "int", None, lo=1, nullable=True)


def warn_ignored(config: Config) -> None:
    """One UserWarning listing every key ``config`` accepted but zfunc does not act on
    (none: no warning)."""
    if config.ignored:
        warnings.warn(
            f"zfunc accepts but does not act on {len(config.ignored)} DeepSpeed config "
            f"key(s) (they tune DeepSpeed's own implementation or tooling): {', '.join(config.ignored)}",
            UserWarning, stacklevel=2,
        )


# --------------------------------------------------------------------------- loading


def _load(config) -> dict:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"DeepSpeed config file {path!r} does not exist")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config file {path!r} is not valid JSON: {e}") from None
        except ValueError as e:  # a duplicate key
            raise ValueError(f"DeepSpeed config file {path!r}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"DeepSpeed config file {path!r} must hold a JSON object, got {type(data).__name__}")
        return data
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ValueError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one JSON object")
        out[key] = value
    return out


# --------------------------------------------------------------------- reading a dict


_ALWAYS = object()


class _Section:
    """One dict of the config: typed reads whose errors name the dotted path, and a
    record of every key read so that :meth:`finish` can reject the rest."""

    def __init__(self, data, path: str, ignored: list, *, auto_is_default: bool = False):
        if not isinstance(data, Mapping):
            raise ValueError(f"{path} must be a dict (JSON object), got {data!r} ({type(data).__name__})")
        self.data, self.path, self.ignored, self.auto = data, path, ignored, auto_is_default
        self.known: list[str] = []

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _value(self, key: str, aliases=()):
        names = [key, *aliases]
        self.known.extend(names)
        given = [n for n in names if n in self.data]
        if len(given) > 1:
            raise ValueError(f"{self.where(given[0])!r} and {self.where(given[1])!r} are the same setting "
                             "(DeepSpeed accepts both names); give one")
        if not given or (self.auto and self.data[given[0]] == "auto"):
            return None, _ALWAYS
        return given[0], self.data[given[0]]

    def get(self, key, kind, default, *, lo=None, hi=None, choices=None, aliases=(), nullable=False):
        name, value = self._value(key, aliases)
        if value is _ALWAYS or (nullable and value is None):
            return default
        return _coerce(self.where(name), value, kind, lo=lo, hi=hi, choices=choices)

    def sub(self, key, *, raw=False, auto_is_default=False):
        """The nested section ``key`` (None when absent or null); ``raw``: the dict itself."""
        name, value = self._value(key)
        if value is _ALWAYS or value is None:
            return None
        if raw:
            return value
        return _Section(value, self.where(name), self.ignored, auto_is_default=auto_is_default)

    def ignore(self, *keys: str) -> None:
        """Keys accepted and listed in ``ignored`` when present."""
        for key in keys:
            self.known.append(key)
            if key in self.data:
                self.ignored.append(self.where(key))

    def fixed(self, key: str, ok, what: str) -> None:
        """``key`` changes semantics zfunc lacks: only DeepSpeed's default ``ok``
        (or null) is accepted. ``ok=_ALWAYS``: any value is refused."""
        self.known.append(key)
        if key not in self.data:
            return
        value = self.data[key]
        if value is None or (self.auto and value == "auto"):
            return
        if ok is not _ALWAYS and type(value) is type(ok) and value == ok:
            return
        allowed = "" if ok is _ALWAYS else f" (only {json.dumps(ok)}, DeepSpeed's default, is accepted)"
        raise ValueError(f"{self.where(key)!r} = {json.dumps(value)}: {what} is not supported yet{allowed}")

    def finish(self) -> None:
        for key in self.data:
            if key not in self.known:
                raise ValueError(_unknown(self.where(key), key, self.known, self.path))


def _unknown(path: str, key: str, valid, where: str) -> str:
    valid = sorted(set(valid))
    near = nearest(key, valid)
    if near:
        return f"unknown key {path!r}: did you mean {near!r}?"
    place = f"in {where}" if where else "at the top level"
    return f"unknown key {path!r} (valid keys {place}: {', '.join(valid)})"


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _coerce(where: str, value, kind: str, *, lo=None, hi=None, choices=None):
    ok = True
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        ok = False
    elif kind == "int":
        ok = value == int(value)  # 1e9 written as a float is the integer 1000000000
        value = int(value) if ok else value
    else:
        value = float(value)
    bounds = (f" >= {lo}" if lo is not None else "") + (f" and <= {hi}" if hi is not None else "")
    if not ok:
        hint = ("; 'auto' is a placeholder the Hugging Face Trainer fills in, DeepSpeed itself does not "
                "accept it here" if value == "auto" else "")
        raise ValueError(f"{where} must be {_EXPECTED[kind]}{bounds}, got {value!r} "
                         f"({type(value).__name__}){hint}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{where} must be {_EXPECTED[kind]}{bounds}, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


# -------------------------------------------------------------------------- sections


_TBS, _MBS, _GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _batch(top: _Section, world: int) -> tuple[int, int, int]:
    """DeepSpeed's rule ``train_batch_size = micro * gas * world size``; any two give the third."""
    tbs, mbs, gas = (top.get(k, "int", None, lo=1) for k in (_TBS, _MBS, _GAS))
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world:
            raise ValueError(f"{_TBS} {tbs} != {_MBS} {mbs} * {_GAS} {gas} * world size {world} = "
                             f"{mbs * gas * world}")
        return tbs, mbs, gas
    if tbs is not None and mbs is not None:
        return tbs, mbs, _divide(tbs, (_MBS, mbs), world, _GAS)
    if tbs is not None and gas is not None:
        return tbs, _divide(tbs, (_GAS, gas), world, _MBS), gas
    if mbs is not None:
        gas = 1 if gas is None else gas
        return mbs * gas * world, mbs, gas
    if tbs is not None:
        return tbs, _divide(tbs, None, world, _MBS), 1
    raise ValueError(f"the config sets no batch size: give {_TBS} or {_MBS} (or any two of {_TBS}, {_MBS}, "
                     f"{_GAS}; DeepSpeed's rule: {_TBS} = {_MBS} * {_GAS} * world size)")


def _divide(tbs: int, other, world: int, result: str) -> int:
    by = world if other is None else other[1] * world
    if tbs % by:
        named = f"world size {world}" if other is None else f"{other[0]} {other[1]} * world size {world} = {by}"
        raise ValueError(f"{_TBS} {tbs} is not divisible by {named}, so {result} would not be a whole number")
    return tbs // by


_DS_OPTIMIZERS_NOT_YET = ("Adagrad", "Lamb", "Lion", "MuAdam", "MuAdamW", "MuSGD", "OneBitAdam",
                          "ZeroOneAdam", "OneBitLamb")


def _optimizer(sec: _Section | None, ignored: list) -> OptimizerConfig | None:
    if sec is None:
        return None
    kind = sec.get("type", "str", None)
    if kind is None:
        raise ValueError("optimizer.type is missing; one of 'Adam', 'AdamW', 'SGD'")
    sec.ignore("legacy_fusion")  # DeepSpeed's fp16 optimizer wrapper variant
    name = kind.lower()
    if name not in ("adam", "adamw", "sgd", "muon"):
        not_yet = [n for n in _DS_OPTIMIZERS_NOT_YET if n.lower() == name] or _torch_optimizer(name)
        if not_yet:
            raise ValueError(f"optimizer.type {kind!r}: the {not_yet[0]} optimizer is not supported yet "
                             "(supported: Adam, AdamW, SGD, Muon)")
        raise ValueError(unknown(f"optimizer.type {kind!r}", kind, ("Adam", "AdamW", "SGD", "Muon"),
                                 label="supported", cutoff=0.5))
    p = sec.sub("params") or _Section({}, "optimizer.params", ignored)
    sec.finish()
    if "max_grad_norm" in p.data:  # DeepSpeed raises on it too
        raise ValueError("optimizer.params.max_grad_norm is not an optimizer parameter in DeepSpeed; "
                         "set the top-level 'gradient_clipping' instead")
    lr = p.get("lr", "float", 1e-3, lo=0.0)
    wd_given = p.get("weight_decay", "float", None, lo=0.0)
    p.fixed("maximize", False, "maximizing")
    p.ignore("foreach", "differentiable")  # torch.optim implementation switches
    if name == "muon":
        momentum = p.get("momentum", "float", 0.95, lo=0.0)
        nesterov = p.get("nesterov", "bool", True)
        ns_steps = p.get("ns_steps", "int", 5, lo=1)
        adjust = p.get("adjust_lr_fn", "str", None, nullable=True)
        betas = _betas(p)
        eps = p.get("eps", "float", 1e-8, lo=0.0)
        p.finish()
        if adjust not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"optimizer.params.adjust_lr_fn must be 'original' or 'match_rms_adamw', got {adjust!r}")
        return OptimizerConfig("muon", lr=lr, betas=betas, eps=eps, weight_decay=0.1 if wd_given is None else wd_given,
                               decoupled=True, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                               adjust_lr_fn=adjust)
    if name == "sgd":
        momentum = p.get("momentum", "float", 0.0, lo=0.0)
        dampening = p.get("dampening", "float", 0.0, lo=0.0)
        nesterov = p.get("nesterov", "bool", False)
        fused = p.get("fused", "bool", None, nullable=True)
        p.finish()
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"optimizer.params.nesterov needs momentum > 0 and dampening 0, got momentum "
                             f"{momentum}, dampening {dampening}")
        return OptimizerConfig("sgd", lr=lr, weight_decay=wd_given or 0.0, momentum=momentum,
                               dampening=dampening, nesterov=nesterov, fused=fused)
    betas = _betas(p)
    eps = p.get("eps", "float", 1e-8, lo=0.0)
    adam_w_mode = p.get("adam_w_mode", "bool", True)
    torch_adam = p.get("torch_adam", "bool", False)
    fused = p.get("fused", "bool", None, nullable=True)
    p.fixed("bias_correction", True, "Adam without bias correction")
    p.fixed("amsgrad", False, "AMSGrad")
    p.fixed("fp32_optimizer_states", True, "optimizer states below fp32")
    p.ignore("set_grad_none", "capturable")  # how DeepSpeed's/torch's kernels run, not what they compute
    p.finish()
    decoupled = name == "adamw" or adam_w_mode  # DeepSpeed's engine: "AdamW" forces it
    # DeepSpeed's defaults: FusedAdam and DeepSpeedCPUAdam decay 0; torch_adam picks
    # torch.optim.AdamW (0.01) or torch.optim.Adam (0).
    wd = wd_given if wd_given is not None else (0.01 if torch_adam and decoupled else 0.0)
    return OptimizerConfig(name, lr=lr, betas=betas, eps=eps, weight_decay=wd, decoupled=decoupled,
                           torch_adam=torch_adam, fused=fused)


def _betas(p: _Section) -> tuple[float, float]:
    name, value = p._value("betas")
    if value is _ALWAYS:
        return (0.9, 0.999)
    where = p.where(name)
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
        raise ValueError(f"{where} must be a list of two numbers in [0, 1), got {value!r}")
    return (float(value[0]), float(value[1]))


def _torch_optimizer(name: str) -> list[str]:
    import torch.optim

    return [n for n in dir(torch.optim) if n.lower() == name and isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)]


def _precision(top: _Section, ignored: list) -> tuple[FP16Config | None, BF16Config | None]:
    fp16 = None
    sec = top.sub("fp16", auto_is_default=True)
    if sec is not None:
        enabled = sec.get("enabled", "bool", False)
        loss_scale = sec.get("loss_scale", "float", 0.0, lo=0.0)
        dynamic_on = enabled and loss_scale == 0
        fp16 = FP16Config(
            enabled=enabled, loss_scale=loss_scale,
            initial_scale_power=sec.get("initial_scale_power", "int", 16, lo=0),
            loss_scale_window=sec.get("loss_scale_window", "int", 1000, lo=1 if dynamic_on else None),
            hysteresis=sec.get("hysteresis", "int", 2, lo=1),
            min_loss_scale=sec.get("min_loss_scale", "int", 1, lo=1 if dynamic_on else None),
            consecutive_hysteresis=sec.get("consecutive_hysteresis", "bool", False),
        )
        sec.ignore("auto_cast")  # units already run in fp16 under mixed precision
        sec.fixed("fp16_master_weights_and_grads", False, "fp16 master weights")
        sec.finish()
    if "bf16" in top.data and "bfloat16" in top.data:
        raise ValueError("'bf16' and 'bfloat16' (its legacy name) are both given; keep 'bf16'")
    bf16 = None
    sec = top.sub("bf16", auto_is_default=True) or top.sub("bfloat16", auto_is_default=True)
    if sec is not None:
        bf16 = BF16Config(enabled=sec.get("enabled", "bool", False),
                          check_grad_overflow=sec.get("check_grad_overflow", "bool", True))
        sec.ignore("immediate_grad_update")  # when DeepSpeed's bf16 optimizer applies gradients, same result
        sec.fixed("bf16_master_weights_and_grads", False, "bf16 master weights")
        sec.fixed("bf16_optimizer_states", False, "bf16 optimizer states")
        sec.finish()
    if fp16 is not None and bf16 is not None and fp16.enabled and bf16.enabled:
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one")
    return fp16, bf16


# zero_optimization keys that only tune how DeepSpeed's own ZeRO runs (bucketing,
# overlap, hooks, checkpoint and debugging switches): the results do not depend on them.
_ZERO_TUNING = (
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm",
    "load_from_fp32_weights", "elastic_checkpoint", "stage3_model_persistence_threshold",
    "model_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold", "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "allgather_sequential", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "parameter_alignment", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory", "leaf_module", "cpu_offload_use_pin_memory",
)


def _zero(sec: _Section | None) -> ZeroConfig:
    if sec is None:
        return ZeroConfig()
    # DeepSpeed's stage-3 knobs have two names each (its config model populates by either).
    big = lambda key, default, alias: sec.get(key, "int", default, lo=0, aliases=(alias,))  # noqa: E731
    out = dict(
        stage=sec.get("stage", "int", 0, lo=0, hi=3),
        stage3_prefetch_bucket_size=big("stage3_prefetch_bucket_size", 50_000_000, "prefetch_bucket_size"),
        stage3_param_persistence_threshold=big("stage3_param_persistence_threshold", 100_000,
                                               "param_persistence_threshold"),
        stage3_max_live_parameters=big("stage3_max_live_parameters", 1_000_000_000, "max_live_parameters"),
        stage3_max_reuse_distance=big("stage3_max_reuse_distance", 1_000_000_000, "max_reuse_distance"),
        sub_group_size=sec.get("sub_group_size", "int", 1_000_000_000, lo=1),
        mics_shard_size=sec.get("mics_shard_size", "int", -1, lo=-1),
        mics_hierarchical_params_gather=sec.get("mics_hierarchical_params_gather", "bool", False),
        zero_hpz_partition_size=sec.get("zero_hpz_partition_size", "int", 1, lo=1),
    )
    if out["zero_hpz_partition_size"] > 1 and out["stage"] != 3:
        raise ValueError(f"{sec.where('zero_hpz_partition_size')} keeps parameters sharded over a node between "
                         "forward and backward, which needs sharded parameters: set zero_optimization.stage to 3")
    if out["mics_shard_size"] == 0:
        raise ValueError(f"{sec.where('mics_shard_size')} is 0: give the number of ranks each shard group spans "
                         "(e.g. a node's), or -1 for no MiCS")
    if out["mics_shard_size"] > 0 and out["stage"] == 0:
        raise ValueError(f"{sec.where('mics_shard_size')} shards the states within groups of ranks, which needs a "
                         "ZeRO stage: set zero_optimization.stage to 1, 2 or 3 (MiCS is DeepSpeed's stage 3)")
    sec.ignore(*_ZERO_TUNING)
    for key, ok, what in (
        ("zero_quantized_weights", False, "ZeRO++ quantized weights"),
        ("zero_quantized_nontrainable_weights", False, "quantized frozen weights"),
        ("zero_quantized_gradients", False, "ZeRO++ quantized gradients"),
        ("zeropp_loco_param", _ALWAYS, "LoCo-ZeRO++"),
        ("zenflow", _ALWAYS, "ZenFlow"),
        ("cpu_offload", False, "the legacy cpu_offload flag (write offload_optimizer {\"device\": \"cpu\"})"),
        ("cpu_offload_param", False, "the legacy cpu_offload_param flag (write offload_param {\"device\": \"cpu\"})"),
    ):
        sec.fixed(key, ok, what)
    offload_param = _offload_param(sec.sub("offload_param", auto_is_default=True), out["stage"])
    offload_opt = _offload_optimizer(sec.sub("offload_optimizer", auto_is_default=True))
    sec.finish()
    return ZeroConfig(offload_param=offload_param, offload_optimizer=offload_opt, **out)


def _nvme_path(sec: _Section, device: str) -> str | None:
    path = sec.get("nvme_path", "str", None, nullable=True)
    if device == "nvme" and not path:
        raise ValueError(f"{sec.where('nvme_path')} is required when {sec.where('device')} is 'nvme'")
    return path


def _offload_param(sec: _Section | None, stage: int) -> OffloadParamConfig | None:
    if sec is None:
        return None
    device = sec.get("device", "str", "none", choices=("none", "cpu", "nvme"))
    if device != "none" and stage != 3:  # DeepSpeed's stages 0-2 never read it (DeepSpeed-Chat's configs set it)
        sec.ignored.append(f"{sec.path} (parameters are offloaded under ZeRO-3 only; stage {stage} keeps them)")
        return None
    out = OffloadParamConfig(
        device=device, nvme_path=_nvme_path(sec, device),
        buffer_count=sec.get("buffer_count", "int", 5, lo=1),
        buffer_size=sec.get("buffer_size", "int", 100_000_000, lo=1),
        pin_memory=sec.get("pin_memory", "bool", True),
        max_in_cpu=sec.get("max_in_cpu", "int", 1_000_000_000, lo=0),
    )
    sec.ignore("max_in_cpu")  # recorded; zfunc's swapper keeps its own bounded buffer pool
    sec.finish()
    return out


def _offload_optimizer(sec: _Section | None) -> OffloadOptimizerConfig | None:
    if sec is None:
        return None
    device = sec.get("device", "str", "none", choices=("none", "cpu", "nvme"))
    ratio = sec.get("ratio", "float", 1.0, lo=0.0, hi=1.0)
    if ratio != 1.0 and device != "cpu":
        raise ValueError(f"zero_optimization.offload_optimizer.ratio {ratio} with device {device!r} is not supported "
                         "yet: a part of the optimizer state is offloaded to the CPU only (device 'cpu'; "
                         "zf.offload_cpu(ratio=...))")
    out = OffloadOptimizerConfig(
        device=device, nvme_path=_nvme_path(sec, device),
        buffer_count=sec.get("buffer_count", "int", 4, lo=1),
        pin_memory=sec.get("pin_memory", "bool", True),
        pipeline_read=sec.get("pipeline_read", "bool", False),
        pipeline_write=sec.get("pipeline_write", "bool", False),
        fast_init=sec.get("fast_init", "bool", False),
        ratio=ratio,
    )
    # Recorded above, but they only schedule DeepSpeed's swapper and CPU Adam.
    sec.ignore("pipeline_read", "pipeline_write", "fast_init", "super_offload", "cpuadam_cores_perc")
    sec.finish()
    return out


# compile keys that only tune how DeepCompile runs (when it frees or copies activations, its
# buffers, syncs and logs): the results do not depend on them.
_COMPILE_TUNING = (
    "free_activation", "free_activation_threshold", "offload_activation_pin_memory", "double_buffer",
    "symmetric_memory", "debug_log", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
    "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors",
)


def compile_kwarg_names() -> tuple[str, ...]:
    """``torch.compile``'s keyword arguments but ``backend`` (given on its own)."""
    import inspect

    import torch

    return tuple(n for n, p in inspect.signature(torch.compile).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "backend")


def _compile(sec: _Section | None, ignored: list) -> CompileConfig | None:
    """The ``compile`` section: DeepSpeed 0.19's keys (``deepcompile`` and DeepCompile's tuning)
    and the first section's ``enabled``, ``backend``, ``kwargs`` (see :class:`CompileConfig`).
    A section that compiles nothing is listed in ``ignored`` whole."""
    if sec is None:
        return None
    mine: list[str] = []
    sec.ignored = mine  # listed only if the section compiles something
    enabled = sec.get("enabled", "bool", False)
    deepcompile = sec.get("deepcompile", "bool", False)
    backend = sec.get("backend", "str", "inductor")
    if not backend:
        raise ValueError("compile.backend must name a torch.compile backend ('inductor', 'aot_eager', ...), got ''")
    _, kwargs = sec._value("kwargs")
    if kwargs is _ALWAYS or kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"compile.kwargs must be a dict of torch.compile's keyword arguments, got {kwargs!r} "
                         f"({type(kwargs).__name__})")
    kwargs = copy.deepcopy(dict(kwargs))
    if "backend" in kwargs:
        raise ValueError("compile.kwargs.backend: give the backend as compile.backend (a sibling of kwargs)")
    valid = compile_kwarg_names() if kwargs else ()
    for key in kwargs:
        if key not in valid:
            raise ValueError(_unknown(f"compile.kwargs.{key}", key, valid, "compile.kwargs (torch.compile's)"))
    sec.ignore(*_COMPILE_TUNING)
    for key, what in (("autoep_non_moe", "AutoEP's non-MoE regional compile"),
                      ("offload_activation", "DeepCompile's activation offload"),
                      ("offload_opt_states", "DeepCompile's optimizer-state offload"),
                      ("offload_parameters", "DeepCompile's parameter offload")):
        sec.fixed(key, False, what)
    _, passes = sec._value("passes")
    if passes is not _ALWAYS and passes is not None:
        if not isinstance(passes, list) or not all(isinstance(p, str) for p in passes):
            raise ValueError(f"compile.passes must be a list of pass names, got {passes!r}")
        for p in passes:
            if p in ("autosp", "autotp"):
                raise ValueError(f"'compile.passes' = {json.dumps(passes)}: DeepCompile's {p!r} pass (automatic "
                                 f"{'sequence' if p == 'autosp' else 'tensor'} parallelism) is not supported yet")
            if p not in ("z1", "z3"):
                raise ValueError(unknown(f"compile.passes entry {p!r}", p, ("z1", "z3", "autosp", "autotp"),
                                         label="DeepCompile's passes", cutoff=0.5))
        mine.append("compile.passes")  # the ZeRO pass follows zero_optimization.stage here
    sec.finish()
    out = CompileConfig(enabled=enabled, backend=backend, kwargs=kwargs, deepcompile=deepcompile)
    if out.on:
        ignored.extend(mine)
    else:  # changes nothing, like a feature section with "enabled": false
        ignored.append("compile")
    return out


def _aio(sec: _Section | None) -> dict | None:
    """The ``aio`` section as given (numbers as ints), for ``zfunc.ops.aio.AsyncIO.from_config``."""
    if sec is None:
        return None
    out = {}
    for key, kind in (("block_size", "int"), ("queue_depth", "int"), ("thread_count", "int"),
                      ("intra_op_parallelism", "int"), ("single_submit", "bool"), ("overlap_events", "bool"),
                      ("use_gds", "bool")):
        value = sec.get(key, kind, None, lo=1 if kind == "int" else None)
        if value is not None:
            out[key] = value
    if "thread_count" in out and "intra_op_parallelism" in out:
        raise ValueError("'aio.thread_count' and 'aio.intra_op_parallelism' are the same setting "
                         "(intra_op_parallelism is DeepSpeed's newer name); give one")
    if out.get("use_gds"):
        raise ValueError("'aio.use_gds' = true: GPUDirect Storage is not supported yet")
    sec.finish()
    return out


# Top-level keys that only drive DeepSpeed's own tooling or implementation details.
_TOP_IGNORED = (
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",  # DeepSpeed's optimizer-selection guards
    # Where DeepSpeed divides by the world size around its all-reduce, and the
    # dtype its collectives use: the mean is the same up to rounding (zfunc
    # reduces in mixed_precision's reduce_dtype, fp32).
    "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "seq_parallel_communication_data_type", "fp32_allreduce", "disable_allgather",
    "sparse_gradients",  # sparse all-reduce of embedding gradients: same values, dense
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers",
    "memory_breakdown", "dump_state", "log_level", "vocabulary_size",  # logging / profiling / one warning
    "checkpoint", "datastates",  # DeepSpeed's checkpoint engines; zfunc writes its own format
    "data_types",  # grad_accum_dtype etc.: zfunc accumulates and keeps master weights in fp32
    "activation_checkpointing",  # configures deepspeed.checkpointing, used only by code that calls it
    "seed",  # not read by DeepSpeed's config; seeding is the script's
    "dataloader_drop_last",  # DeepSpeed's own data loader
    "managed_gradient_accumulation", "disable_python_gc",  # DeepSpeed engine API / GC behaviour
    "use_data_before_expert_parallelism",  # process-group layout for MoE
)

# Top-level DeepSpeed features zfunc does not have.
_TOP_NOT_YET = {
    "amp": "NVIDIA Apex AMP", "pipeline": "DeepSpeed's pipeline engine section (pipeline parallelism comes later)",
    "sparse_attention": "sparse attention", "elasticity": "elastic training",
    "compression_training": "the compression library", "autotuning": "the autotuner",
    "quantize_training": "MoQ quantized training", "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency (curriculum / random-LTD)",
    "moe": "DeepSpeed's mixture of experts with expert parallelism (a Hugging Face MoE model, Mixtral's, trains "
           "as any model: ZeRO-3 shards its experts; leave the section out)",
    "expert_parallel": "expert parallelism (ZeRO-3 shards a MoE model's experts over the data-parallel ranks; "
                       "leave the section out)",
    "hybrid_engine": "the RLHF hybrid engine (for generation between steps use zf.bind(state, model) or "
                     "engine.module.generate(...), which gather one unit at a time)",
    "tensor_parallel": "tensor parallelism (AutoTP; shard the model with ZeRO-3, zero_optimization.stage 3, "
                       "instead)",
    "sequence_parallel_size": "sequence parallelism (DeepSpeed Ulysses / ALST; for long sequences use ZeRO-3 "
                              "with activation checkpointing and offload)",
    "torch_autocast": "torch.autocast mixed precision (use fp16 / bf16)",
    "weight_quantization": "weight quantization", "eigenvalue": "eigenvalue-based MoQ",
    "progressive_layer_drop": "progressive layer dropping", "graph_harvesting": "graph harvesting",
    "nebula": "Nebula checkpointing",
}


def _top_level_rest(top: _Section) -> None:
    top.ignore(*_TOP_IGNORED)
    top.fixed("gradient_allreduce_op", "mean", "summing gradients across ranks instead of averaging")
    for key, what in _TOP_NOT_YET.items():
        top.known.append(key)
        if key not in top.data:
            continue
        value = top.data[key]
        harmless = ((isinstance(value, Mapping) and value.get("enabled") is False)
                    or (key == "sequence_parallel_size" and value == 1)
                    or (key == "tensor_parallel" and isinstance(value, Mapping)
                        and set(value) <= {"autotp_size", "tp_size"} and all(v in (0, 1) for v in value.values())))
        if not harmless:
            raise ValueError(f"{key!r}: {what} is not supported yet")
        top.ignored.append(key)
