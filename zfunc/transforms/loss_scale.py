"""Loss scaling for fp16: DeepSpeed's dynamic rules as a pure update of a small state.

fp16 has 5 exponent bits: gradients of a typical loss underflow to zero. The
step multiplies the loss by ``scale`` before backward and the optimizer divides
the gradients by it (folded into the fused update). When any gradient on any
rank is inf or NaN the step is skipped and the scale lowered; after ``window``
overflow-free steps it is raised again. The rules and defaults are DeepSpeed's
``DynamicLossScaler`` (``fp16`` config: ``initial_scale_power`` 16,
``loss_scale_window`` 1000, ``hysteresis`` 2, ``min_loss_scale`` 1,
``consecutive_hysteresis`` false):

* overflow: if ``hysteresis`` is 1 or the hysteresis left is 1, the scale is
  divided by ``factor`` (not below ``min_scale``); else one unit of hysteresis
  is used up instead. The iteration is remembered as the last overflow.
* no overflow: with ``consecutive_hysteresis`` the hysteresis is restored;
  when ``(iteration - last overflow) % window == 0`` the scale is multiplied by
  ``factor`` (and, without ``consecutive_hysteresis``, the hysteresis restored).
* the iteration counts every step, skipped or not.

Unlike DeepSpeed, which raises the first time an overflow meets the minimum
scale, a scale stuck at ``min_scale`` is given ``max_stuck_steps`` consecutive
overflow steps before the step raises, saying what to try.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LossScaleState(NamedTuple):
    """The scaler's part of ``State`` (0-d CPU tensors, so checkpoints keep it)."""

    scale: torch.Tensor  # float64: the scale the next step uses
    iteration: torch.Tensor  # int64: steps taken under this scaler, skipped ones included
    last_overflow: torch.Tensor  # int64: the iteration of the last overflow (-1: none yet)
    hysteresis: torch.Tensor  # int64: overflows still tolerated before the scale drops
    stuck: torch.Tensor  # int64: consecutive overflow steps taken at the minimum scale
    skipped: torch.Tensor  # int64: steps skipped for overflow, in all


@dataclass(frozen=True)
class LossScaler:
    """The rules (module docstring); ``dynamic=False`` keeps ``init_scale`` fixed
    (overflowing steps are still skipped)."""

    init_scale: float = 2.0 ** 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    consecutive_hysteresis: bool = False
    max_stuck_steps: int = 100
    dynamic: bool = True

    def __post_init__(self):
        if not self.init_scale > 0 or not self.min_scale > 0:
            raise ValueError(f"LossScaler: init_scale and min_scale must be > 0, got {self.init_scale}, {self.min_scale}")
        if self.dynamic and self.init_scale < self.min_scale:
            raise ValueError(f"LossScaler: init_scale {self.init_scale} is below min_scale {self.min_scale}")
        if self.window < 1 or self.hysteresis < 1 or self.max_stuck_steps < 1 or not self.factor > 1:
            raise ValueError(
                f"LossScaler: window, hysteresis and max_stuck_steps must be >= 1 and factor > 1, got "
                f"window={self.window}, hysteresis={self.hysteresis}, max_stuck_steps={self.max_stuck_steps}, "
                f"factor={self.factor}"
            )

    def init(self) -> LossScaleState:
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return LossScaleState(torch.tensor(float(self.init_scale), dtype=torch.float64), i64(0), i64(-1),
                              i64(self.hysteresis), i64(0), i64(0))

    def update(self, s: LossScaleState, overflow: bool) -> LossScaleState:
        """The state after a step that did (not) overflow. Raises when the scale has
        been at its floor with overflow for ``max_stuck_steps`` steps in a row."""
        scale, it, last, hyst = float(s.scale), int(s.iteration), int(s.last_overflow), int(s.hysteresis)
        floor = self.min_scale if self.dynamic else self.init_scale
        stuck = int(s.stuck) + 1 if overflow and scale <= floor else 0
        if stuck >= self.max_stuck_steps:
            raise FloatingPointError(
                f"fp16 gradients have overflowed (inf or NaN) on {stuck} consecutive steps with the loss scale "
                f"at its {'minimum' if self.dynamic else 'fixed value'} {scale:g}: the model overflows fp16 "
                "even unscaled, and every one of those steps was skipped. Try bf16 "
                "(zf.mixed_precision(step, torch.bfloat16)), a lower learning rate, gradient clipping, or look for "
                "inf/NaN in the data; LossScaler(min_scale=..., max_stuck_steps=...) sets the limits. The state "
                "passed to this step is intact."
            )
        if self.dynamic and overflow:
            if self.hysteresis == 1 or hyst == 1:
                scale = max(scale / self.factor, self.min_scale)
            else:
                hyst -= 1
            last = it
        elif self.dynamic:
            if self.consecutive_hysteresis:
                hyst = self.hysteresis
            if (it - last) % self.window == 0:
                if not self.consecutive_hysteresis:
                    hyst = self.hysteresis
                scale *= self.factor
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return LossScaleState(torch.tensor(scale, dtype=torch.float64), i64(it + 1), i64(last), i64(hyst),
                              i64(stuck), s.skipped + int(overflow))


def as_scaler(loss_scale) -> LossScaler | None:
    """``mixed_precision``'s ``loss_scale``: None, "dynamic", a number (fixed) or a LossScaler."""
    if loss_scale is None or isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale == "dynamic":
        return LossScaler()
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0:
        return LossScaler(init_scale=float(loss_scale), dynamic=False)
    raise ValueError(
        f"loss_scale must be None, 'dynamic', a number > 0 (a fixed scale) or a zf.LossScaler, got {loss_scale!r}"
    )
