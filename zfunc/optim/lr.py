"""Learning-rate schedules: functions ``step -> lr``, the one ``Schedule`` type.

A zfunc optimizer calls its schedule with ``step``, the number of updates
applied before the current one (0 for the first), as
``torch.optim.lr_scheduler.LambdaLR`` counts. Two families live here, both
re-exported by :mod:`zfunc.optim`:

optax-style
    :func:`constant`, :func:`linear_schedule`, :func:`linear_warmup`,
    :func:`cosine_decay`, :func:`warmup_cosine_decay`; each matches the torch
    scheduler named in its docstring.

DeepSpeed's
    :func:`warmup_lr`, :func:`warmup_decay_lr`, :func:`warmup_cosine_lr`.
    DeepSpeed sets the torch param groups' lr when it builds the scheduler and
    again in ``scheduler.step()``, which its engine calls *after* each optimizer
    step. So update ``step`` runs with the lr DeepSpeed computes for its
    ``last_batch_iteration = step - 1``, and the first update (iteration -1)
    runs at ``warmup_min_lr`` (``WarmupLR``, ``WarmupDecayLR``) or at 0
    (``WarmupCosineLR``). The functions here reproduce that exactly, so a run
    configured from a DeepSpeed JSON gets the same lr at every update.

    Also as in DeepSpeed: a warmup shorter than 2 steps is stretched to 2 (the
    log warmup divides by ``log(warmup_num_steps)``); the log warmup rises as
    ``log(i + 1) / log(warmup_num_steps)``, the linear one as
    ``i / warmup_num_steps``. Where DeepSpeed only logs a warning (an unknown
    ``warmup_type``, a total shorter than the warmup) these raise, naming the key.

    :func:`from_config` builds one from a DeepSpeed ``"scheduler"`` section;
    :func:`validate` checks a section without building it (the config parser
    uses it before the optimizer's lr is known).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Union

from ..ops._names import unknown

Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]

WARMUP_TYPES = ("log", "linear")
SUPPORTED = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
NOT_SUPPORTED_YET = ("OneCycle", "LRRangeTest")

# Each type's params with their DeepSpeed defaults (deepspeed/runtime/lr_schedules.py,
# 0.19.8). REQUIRED has no default. WarmupLR's warmup_max_lr defaults to the
# optimizer's lr there (None in its signature); from_config fills that in.
REQUIRED = object()
PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
}


# ------------------------------------------------------------- optax-style schedules


def as_schedule(name: str, lr: ScalarOrSchedule) -> Schedule:
    """``lr`` as a schedule: a callable as it is, a number ``>= 0`` as :func:`constant`;
    ``name`` (the optimizer's) is in the error."""
    if callable(lr):
        return lr
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"{name}: lr must be a float >= 0 or a schedule step -> float, got {lr!r}")
    return constant(float(lr))


def constant(value: float) -> Schedule:
    """``step -> value``."""
    value = float(value)
    return lambda step: value


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Hold ``init_value`` until ``transition_begin``, move linearly to ``end_value``
    over ``transition_steps`` steps, then hold ``end_value`` (``LinearLR``)."""
    if transition_steps <= 0:
        raise ValueError(f"linear_schedule: transition_steps must be > 0, got {transition_steps}")

    def schedule(step):
        frac = min(max(step - transition_begin, 0), transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` at step 0 to ``peak_value`` at ``warmup_steps``, then flat."""
    if warmup_steps <= 0:
        return constant(peak_value)
    return linear_schedule(init_value, peak_value, warmup_steps)


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Half a cosine from ``init_value`` to ``alpha * init_value`` over ``decay_steps``,
    then flat (``CosineAnnealingLR(T_max=decay_steps, eta_min=alpha * init_value)``)."""
    return _cosine("cosine_decay", init_value, alpha * init_value, decay_steps)


def warmup_cosine_decay(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    half a cosine down to ``end_value``; ``decay_steps`` counts the warmup too."""
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay: decay_steps ({decay_steps}) counts the warmup and "
            f"must exceed warmup_steps ({warmup_steps})"
        )
    warmup = linear_warmup(peak_value, warmup_steps, init_value)
    decay = _cosine("warmup_cosine_decay", peak_value, end_value, decay_steps - warmup_steps)

    def schedule(step):
        return warmup(step) if step < warmup_steps else decay(step - warmup_steps)

    return schedule


def _cosine(name: str, start: float, end: float, steps: int) -> Schedule:
    if steps <= 0:
        raise ValueError(f"{name}: decay_steps must be > 0, got {steps}")

    def schedule(step):
        t = min(max(step, 0), steps) / steps
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))

    return schedule


# ------------------------------------------------------------ DeepSpeed's schedules


def warmup_lr(warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
              warmup_type: str = "log") -> Schedule:
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` up to ``warmup_max_lr`` over
    ``warmup_num_steps`` updates, then flat. (From a config without
    ``warmup_max_lr`` DeepSpeed uses the optimizer's lr; :func:`from_config` does too.)"""
    lo = _nonneg_float("warmup_min_lr", warmup_min_lr)
    hi = _nonneg_float("warmup_max_lr", warmup_max_lr)
    ramp = _warmup("WarmupLR", warmup_num_steps, warmup_type)

    def schedule(step: int) -> float:
        it = step - 1  # DeepSpeed's last_batch_iteration when update `step` runs
        if it < 0:
            return lo
        return lo + (hi - lo) * ramp(it)

    return schedule


def warmup_decay_lr(total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                    warmup_num_steps: int = 1000, warmup_type: str = "log") -> Schedule:
    """DeepSpeed's ``WarmupDecayLR``: :func:`warmup_lr`'s warmup, then linearly from
    ``warmup_max_lr`` back to ``warmup_min_lr`` at ``total_num_steps`` (which counts
    the warmup), then flat there."""
    lo = _nonneg_float("warmup_min_lr", warmup_min_lr)
    hi = _nonneg_float("warmup_max_lr", warmup_max_lr)
    ramp = _warmup("WarmupDecayLR", warmup_num_steps, warmup_type)
    total = _total("WarmupDecayLR", total_num_steps, warmup_num_steps)
    span = max(1, total - ramp.steps)

    def schedule(step: int) -> float:
        it = step - 1
        if it < 0:
            return lo
        gamma = ramp(it) if it < ramp.steps else max(0.0, (total - it) / span)
        return lo + (hi - lo) * gamma

    return schedule


def warmup_cosine_lr(total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                     cos_min_ratio: float = 0.0001, warmup_type: str = "log", *, base_lr: float) -> Schedule:
    """DeepSpeed's ``WarmupCosineLR``: ``base_lr`` (the optimizer's lr) times a ratio
    that warms up from ``warmup_min_ratio`` to 1, then follows half a cosine down
    to ``cos_min_ratio`` at ``total_num_steps`` and stays there. The first update
    runs at lr 0, as under DeepSpeed."""
    base = _nonneg_float("base_lr", base_lr)
    r0 = _nonneg_float("warmup_min_ratio", warmup_min_ratio)
    rmin = _nonneg_float("cos_min_ratio", cos_min_ratio)
    ramp = _warmup("WarmupCosineLR", warmup_num_steps, warmup_type)
    total = _total("WarmupCosineLR", total_num_steps, warmup_num_steps)
    span = max(1, total - ramp.steps)

    def schedule(step: int) -> float:
        it = step - 1
        if it < 0:
            return 0.0
        if it < ramp.steps:
            return base * (r0 + (1.0 - r0) * ramp(it))
        progress = min(1.0, (it - ramp.steps + 1) / span)
        return base * max(0.0, rmin + (1.0 - rmin) * 0.5 * (1.0 + math.cos(math.pi * progress)))

    return schedule


class _Ramp:
    """The warmup fraction at DeepSpeed iteration ``it`` (0 at the start, 1 when done)."""

    def __init__(self, steps: int, kind: str):
        self.steps, self.kind = steps, kind
        self._inv_log = 1.0 / math.log(steps)

    def __call__(self, it: int) -> float:
        if it >= self.steps:
            return 1.0
        if self.kind == "log":
            return self._inv_log * math.log(it + 1)
        return it / self.steps


def _warmup(name: str, warmup_num_steps, warmup_type) -> _Ramp:
    steps = _int("warmup_num_steps", warmup_num_steps, minimum=1)
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {', '.join(map(repr, WARMUP_TYPES))} "
                         f"for {name}, got {warmup_type!r}")
    return _Ramp(max(2, steps), warmup_type)  # DeepSpeed stretches a 1-step warmup to 2


def _total(name: str, total_num_steps, warmup_num_steps) -> int:
    total = _int("total_num_steps", total_num_steps, minimum=1)
    warmup = _int("warmup_num_steps", warmup_num_steps, minimum=1)
    if total <= warmup:
        raise ValueError(f"total_num_steps ({total}) counts the warmup and must exceed "
                         f"warmup_num_steps ({warmup}) for {name}")
    return total


def _int(key: str, value, *, minimum: int) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or value < minimum):
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _nonneg_float(key: str, value) -> float:
    if isinstance(value, (list, tuple)):
        raise ValueError(f"{key}: per-param-group lists are not supported yet; give one number, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------- from a config


def validate(section: Mapping[str, Any], where: str = "scheduler") -> tuple[str, dict[str, Any]]:
    """Check a DeepSpeed ``"scheduler"`` section; return its type and its params with
    DeepSpeed's defaults filled in (WarmupLR's ``warmup_max_lr`` stays None: the
    optimizer's lr). Errors name the key as ``{where}.params.<key>``."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where} must be a dict with 'type' and 'params', got {type(section).__name__}")
    for key in section:
        if key not in ("type", "params"):
            path = f"{where}.{key}"
            raise ValueError(unknown(f"key {path!r}", key, ("type", "params"), label="valid keys"))
    if "type" not in section:
        raise ValueError(f"{where}.type is missing; one of {', '.join(SUPPORTED)}")
    kind = section["type"]
    if kind in NOT_SUPPORTED_YET:
        raise ValueError(f"{where}.type {kind!r}: DeepSpeed's {kind} scheduler is not supported yet "
                         f"(supported: {', '.join(SUPPORTED)}); pass a zfunc schedule as the optimizer's lr instead")
    if kind not in SUPPORTED:
        if isinstance(kind, str) and _is_torch_scheduler(kind):
            raise ValueError(f"{where}.type {kind!r}: torch.optim.lr_scheduler.{kind} is not supported yet "
                             f"(supported: {', '.join(SUPPORTED)}); pass a zfunc schedule as the optimizer's lr")
        raise ValueError(unknown(f"{where}.type {kind!r}", kind, SUPPORTED,
                                 candidates=SUPPORTED + NOT_SUPPORTED_YET, cutoff=0.5))
    params = section.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.params must be a dict, got {type(params).__name__}")
    known = PARAMS[kind]
    for key in params:
        if key not in known:
            path = f"{where}.params.{key}"
            raise ValueError(unknown(f"key {path!r}", key, tuple(known), label=f"{kind}'s params"))
    missing = [k for k, v in known.items() if v is REQUIRED and k not in params]
    if missing:
        raise ValueError(f"{where}.params.{missing[0]} is required for {kind}")
    merged = {**known, **params}
    if merged.pop("last_batch_iteration") != -1:
        raise ValueError(f"{where}.params.last_batch_iteration: resuming a schedule at another iteration "
                         "is not supported yet (zfunc's schedule reads the optimizer's own update count); "
                         "leave it at -1")
    try:  # build once with a stand-in lr so every value is checked where it is given
        _build(kind, merged, 1.0)
    except ValueError as e:
        raise ValueError(f"{where}.params.{e}") from None
    return kind, merged


def from_config(scheduler_section: Mapping[str, Any], optimizer_lr: float) -> Schedule:
    """The schedule for a DeepSpeed ``{"type": ..., "params": {...}}`` section.

    ``optimizer_lr`` is the optimizer's lr: WarmupLR's ``warmup_max_lr`` when the
    section gives none, and WarmupCosineLR's base lr (as DeepSpeed reads them).
    """
    kind, params = validate(scheduler_section)
    return _build(kind, params, optimizer_lr)


def _build(kind: str, params: dict[str, Any], optimizer_lr: float) -> Schedule:
    p = dict(params)
    p.pop("last_batch_iteration", None)
    if kind == "WarmupLR":
        if p["warmup_max_lr"] is None:
            p["warmup_max_lr"] = optimizer_lr
        return warmup_lr(**p)
    if kind == "WarmupDecayLR":
        return warmup_decay_lr(**p)
    return warmup_cosine_lr(**p, base_lr=optimizer_lr)


def _is_torch_scheduler(name: str) -> bool:
    try:
        import torch.optim.lr_scheduler as torch_sched
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    cls = getattr(torch_sched, name, None)
    return isinstance(cls, type) and name[:1].isupper()
