"""Mixed precision as a step transform: bf16/fp16 parameters, fp32 master weights.

``mixed_precision(step, dtype)`` changes three things:

* placement: each unit is stored in ``dtype`` (2 bytes per parameter, as
  DeepSpeed and FSDP2 hold them), so it is gathered in ``dtype`` (half the
  all-gather bytes of fp32) and the forward and backward run in it; gradients
  are reduced in ``reduce_dtype`` (fp32 by default, like FSDP2's
  ``MixedPrecisionPolicy``; ``reduce_dtype=dtype`` halves the bytes, as
  DeepSpeed does) and kept in ``dtype``, so ZeRO's formulas hold with P = G = 2.
  Frozen parameters are cast to ``dtype`` too, except those ``keep`` names.
  Buffers keep their own dtype, as under FSDP2's ``MixedPrecisionPolicy`` and
  autocast (Llama's rotary ``inv_freq`` stays fp32: positions keep their
  precision); ``buffer_dtype=dtype`` casts the floating ones (except ``keep``),
  for models whose forward mixes buffers into activations (BatchNorm, an added
  fp32 buffer) and so needs them in the compute dtype.
* the update: the optimizer state holds the fp32 master copy of this rank's
  part (``MixedPrecisionState``; with AdamW's moments K = 12 bytes per
  parameter). One fused pass unscales the gradients, applies the clip factor,
  updates the master and writes the ``dtype`` copy.
* fp16: ``loss_scale="dynamic"`` (DeepSpeed's rules, zfunc.transforms.loss_scale) or a
  fixed number; a step whose gradients overflow on any rank is skipped.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, NamedTuple

import torch

from .loss_scale import LossScaler, as_scaler
from ..optim.base import Optimizer, apply_update
from ..placement import Placement
from ..pytree import tree_map
from ..step import Step, expect_step
from ..transform import Transform, check_inside_zero

_LOW = (torch.bfloat16, torch.float16)


class MixedPrecisionState(NamedTuple):
    """The optimizer state under mixed precision: fp32 master weights (this rank's
    part, structured like the parameters) and the inner optimizer's state over them."""

    master: Any
    inner: Any


class MixedPrecision(Transform):
    family = "precision"

    def __init__(self, dtype: torch.dtype, reduce_dtype: torch.dtype, scaler: LossScaler | None,
                 keep: Callable[[str], bool], buffer_dtype: torch.dtype | None = None):
        self.dtype, self.reduce_dtype, self.scaler, self.keep = dtype, reduce_dtype, scaler, keep
        self.buffer_dtype = buffer_dtype

    @property
    def name(self) -> str:
        return "mixed_precision"

    def describe(self, inner: str) -> str:
        extra = "" if self.reduce_dtype == torch.float32 else f", reduce_dtype={_short(self.reduce_dtype)}"
        if self.buffer_dtype is not None:
            extra += f", buffer_dtype={_short(self.buffer_dtype)}"
        if self.scaler is not None:
            extra += ", loss_scale=" + ("dynamic" if self.scaler.dynamic else f"{self.scaler.init_scale:g}")
        return f"mixed_precision({inner}, {_short(self.dtype)}{extra})"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(mixed_precision(f, dtype))")
        for t in inner:
            if t.family == "offload":
                raise ValueError(
                    f"mixed_precision must go inside {t.name}, which offloads what is inside it (the fp32 "
                    f"master weights too): write zeroN({t.name}(mixed_precision(f, dtype))), not "
                    f"mixed_precision({t.name}(...))"
                )

    def place(self, p: Placement, unit) -> Placement:
        frozen = [e.name for e in unit.frozen.entries]
        kept = [n for n in frozen if self.keep(n)]
        if kept and len(kept) != len(frozen):
            raise ValueError(
                f"mixed_precision keep= names frozen parameters {kept} of unit {unit.name or '<root>'!r} but not "
                f"{sorted(set(frozen) - set(kept))}: a unit's frozen parameters share one buffer, so keep all "
                "of them or none"
            )
        frozen_dtype = None if kept else (self.dtype if unit.frozen.dtype.is_floating_point else None)
        return replace(p, param_dtype=self.dtype, frozen_dtype=frozen_dtype, reduce_dtype=self.reduce_dtype)

    @property
    def loss_scaler(self) -> LossScaler | None:
        return self.scaler

    def cast_buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.buffer_dtype is not None and t.is_floating_point() and not self.keep(name):
            return t.to(self.buffer_dtype)
        return t

    def wrap_optimizer(self, optimizer):
        if getattr(optimizer.init, "forward_only", False):  # an engine that never updates: no master copy
            return optimizer
        return master_weights(optimizer)


def master_weights(optimizer) -> Optimizer:
    """``optimizer`` over fp32 master copies; the low-precision parameters are written by its update.

    ``init`` runs before the parameters are cast (``Step.init``), so the master
    starts from the model's own values, not their rounding.
    """

    def init(params):
        master = tree_map(lambda p: p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True), params)
        return MixedPrecisionState(master, optimizer.init(master))

    def update(grads, opt_state, params, **kw):
        kw.pop("lowp_params", None)  # ours are the parameters themselves
        master, inner = apply_update(optimizer, grads, opt_state.inner, opt_state.master, lowp_params=params, **kw)
        return params, MixedPrecisionState(master, inner)

    return Optimizer(init, update, fuses=True, defers=getattr(optimizer, "defers", False))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _keep_predicate(keep) -> Callable[[str], bool]:
    if keep is None:
        return lambda name: False
    if callable(keep):
        return keep
    if isinstance(keep, str):
        raise TypeError("keep must be a collection of names or a predicate name -> bool, got a string")
    names = frozenset(keep)
    return lambda name: name in names


def mixed_precision(step: Step, dtype: torch.dtype = torch.bfloat16, *, loss_scale=None,
                    reduce_dtype: torch.dtype = torch.float32, buffer_dtype: torch.dtype | None = None,
                    keep: Iterable[str] | Callable[[str], bool] | None = None) -> Step:
    """Compute in ``dtype`` with fp32 master weights in the optimizer state (module docstring).

    ``loss_scale``: ``None`` (bf16), ``"dynamic"`` (DeepSpeed's rules and
    defaults) or a number (a fixed scale) for fp16, or a ``zf.LossScaler`` to
    set the rules. Metrics gain ``loss_scale`` and ``skipped``. ``buffer_dtype``:
    None (the default, FSDP2's): buffers stay in their own dtype; a floating dtype:
    floating buffers are cast to it. ``keep``: names of buffers and frozen
    parameters (or a predicate on them) that stay in their own dtype. Write it
    inside the ZeRO stage: ``zero3(mixed_precision(f))``.
    """
    expect_step(step, "mixed_precision")
    if dtype not in _LOW:
        raise ValueError(f"mixed_precision: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise ValueError(f"mixed_precision: reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
    if buffer_dtype is not None and not (isinstance(buffer_dtype, torch.dtype) and buffer_dtype.is_floating_point):
        raise ValueError(f"mixed_precision: buffer_dtype must be None (buffers keep their own dtype) or a "
                         f"floating-point dtype, got {buffer_dtype}")
    scaler = as_scaler(loss_scale)
    if dtype == torch.float16 and scaler is None:
        raise ValueError(
            "mixed_precision with torch.float16 needs a loss scale, or small gradients underflow to zero: "
            "pass loss_scale='dynamic' (or a fixed number), or use torch.bfloat16"
        )
    return step.then(MixedPrecision(dtype, reduce_dtype, scaler, _keep_predicate(keep), buffer_dtype))
