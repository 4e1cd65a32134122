"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five lr schedulers as schedulers over a torch
optimizer, each setting every param group's lr (OneCycle also Adam's ``betas``) to DeepSpeed's
value at each ``step()``, and ``VALID_LR_SCHEDULES``.

Each follows DeepSpeed's protocol: built with ``last_batch_iteration=-1`` it writes the first
values into the groups; ``step()`` (DeepSpeed's engine calls it after each update) advances
``last_batch_iteration`` and writes the next; ``get_lr()``, ``get_last_lr()``, ``state_dict()`` /
``load_state_dict()`` (``{"last_batch_iteration": n}``). Values given as lists are per param
group. WarmupLR, WarmupDecayLR and WarmupCosineLR read zfunc's schedules (zfunc.optim.lr: DeepSpeed's
value at iteration ``i`` is the schedule at update ``i + 1``); OneCycle and LRRangeTest are computed
here. Handed to ``deepspeed.initialize(lr_scheduler=)``, zfunc follows them as it follows any torch
scheduler (zfunc.deepspeed.client). Where DeepSpeed only warns (an unknown ``warmup_type``, a total
shorter than the warmup) zfunc's schedules raise, naming the argument.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable

from ...optim import lr as zlr

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


def _torch_optimizer(optimizer):
    """The torch optimizer whose groups are written (a wrapper's ``.optimizer``, as DeepSpeed unwraps)."""
    while not hasattr(optimizer, "param_groups") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"{type(optimizer).__name__} is not an optimizer (no param_groups)")
    return optimizer


def _per_group(optimizer, value, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} values for {name} (one per param group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class _Scheduler:
    """DeepSpeed's scheduler protocol over per-group functions ``iteration -> lr``."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            self._apply()

    def _lrs(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self._lrs(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("get_last_lr(): call step() first (no lr was set at construction)")
        return self._last_lr

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class _FromSchedules(_Scheduler):
    """One zfunc schedule per group: DeepSpeed's lr at iteration ``i`` is the schedule at ``i + 1``."""

    schedules: list[Callable[[int], float]]

    def _lrs(self, iteration: int) -> list[float]:
        return [s(iteration + 1) for s in self.schedules]


class WarmupLR(_FromSchedules):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (each group's lr when None) over
    ``warmup_num_steps`` steps, ``"log"`` or ``"linear"``, then flat."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        opt = _torch_optimizer(optimizer)
        highs = [g["lr"] for g in opt.param_groups] if warmup_max_lr is None else _per_group(opt, warmup_max_lr, "warmup_max_lr")
        lows = _per_group(opt, warmup_min_lr, "warmup_min_lr")
        self.schedules = [zlr.warmup_lr(lo, hi, warmup_num_steps, warmup_type) for lo, hi in zip(lows, highs)]
        super().__init__(optimizer, last_batch_iteration)


class WarmupDecayLR(_FromSchedules):
    """WarmupLR's warmup, then linearly back to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        opt = _torch_optimizer(optimizer)
        lows = _per_group(opt, warmup_min_lr, "warmup_min_lr")
        highs = _per_group(opt, warmup_max_lr, "warmup_max_lr")
        self.schedules = [zlr.warmup_decay_lr(total_num_steps, lo, hi, warmup_num_steps, warmup_type)
                          for lo, hi in zip(lows, highs)]
        super().__init__(optimizer, last_batch_iteration)


class WarmupCosineLR(_FromSchedules):
    """Each group's own lr times a ratio warming up from ``warmup_min_ratio`` to 1, then half a
    cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        opt = _torch_optimizer(optimizer)
        self.org_lrs = [g["lr"] for g in opt.param_groups]
        self.schedules = [zlr.warmup_cosine_lr(total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio,
                                               warmup_type, base_lr=lr) for lr in self.org_lrs]
        super().__init__(optimizer, last_batch_iteration)


class LRRangeTest(_Scheduler):
    """The lr range test: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * k)``, ``k`` the
    iterations done over ``lr_range_test_step_size`` (whole intervals with ``staircase``)."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        self.min_lr = _per_group(_torch_optimizer(optimizer), lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate, self.staircase = lr_range_test_step_size, lr_range_test_step_rate, lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)
        if last_batch_iteration == -1:  # DeepSpeed starts the groups at the minimum
            self._last_lr = list(self.min_lr)
            for group, lr in zip(self.optimizer.param_groups, self.min_lr):
                group["lr"] = lr

    def _lrs(self, iteration: int) -> list[float]:
        k = (iteration + 1) / self.step_size
        if self.staircase:
            k = math.floor(k)
        return [lr * (1 + self.step_rate * k) for lr in self.min_lr]


class OneCycle(_Scheduler):
    """One cycle of the lr from ``cycle_min_lr`` up to ``cycle_max_lr`` (``cycle_first_step_size``
    iterations) and back (``cycle_second_step_size``), optionally in stairs, then decay by
    ``decay_lr_rate`` every ``decay_step_size`` iterations; with ``cycle_momentum`` (and an
    optimizer with ``betas``) Adam's first beta moves inversely between ``cycle_max_mom`` and
    ``cycle_min_mom``, the second set to 0.99, as DeepSpeed sets them."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        opt = _torch_optimizer(optimizer)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.first, self.second, self.total = first, second, first + second
        self.ratio = first / self.total
        self.stairs = (cycle_first_stair_count,
                       cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(opt, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(opt, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = 0.0 if math.isclose(decay_step_size, 0) else decay_lr_rate
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in opt.defaults:
            warnings.warn(f"OneCycle: cycle_momentum is off, the {type(opt).__name__} has no betas")
            self.cycle_momentum = False
        self.decay_mom_rate = 0.0 if math.isclose(decay_step_size, 0) else decay_mom_rate
        self.min_moms = _per_group(opt, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(opt, cycle_max_mom, "cycle_max_mom")
        self.optimizer = opt
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:  # DeepSpeed starts at the minimum lr and momentum
            for group, lr, mom in zip(opt.param_groups, self.min_lrs, self.min_moms):
                group["lr"] = lr
                if self.cycle_momentum:
                    group["betas"] = (mom, 0.99)

    def _scale(self, iteration: int) -> float:
        it = iteration + 1
        x = 1.0 + it / self.total - math.floor(1 + it / self.total)
        rising = x <= self.ratio
        scale = x / self.ratio if rising else (x - 1) / (self.ratio - 1)
        stairs = self.stairs[0] if rising else self.stairs[1]
        if stairs > 0:
            within = it % self.total
            position = (within * stairs / self.first if within <= self.first
                        else (self.total - within) * stairs / self.second)
            scale = math.floor(position) / stairs
        return scale

    def _lrs(self, iteration: int) -> list[float]:
        if iteration < self.total:
            s = self._scale(iteration)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (iteration - self.total + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self):
        """Each group's ``betas`` at the current iteration (None without cycle_momentum)."""
        if not self.cycle_momentum:
            return None
        it = self.last_batch_iteration
        if it < self.total:
            s = self._scale(it)
            return [(hi - (hi - lo) * s, 0.99) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_mom_rate == 0:
            return [(hi, 0.99) for hi in self.max_moms]
        factor = 1 + self.decay_mom_rate * (it - self.total + 1) / self.decay_step_size
        return [(hi * factor, 0.99) for hi in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas
