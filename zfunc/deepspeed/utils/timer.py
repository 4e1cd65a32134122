"""``deepspeed.utils.timer.ThroughputTimer``: the engine's ``tput_timer`` as scripts read it
(DeepSpeed-Chat calls ``engine.tput_timer.update_epoch_count()`` after each epoch).

DeepSpeed's engine starts and stops it around each step; here it reads the engine's own counters,
so ``avg_samples_per_sec()`` is the samples of the updates applied since ``initialize`` over the
seconds since then.
"""
from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """See the module docstring. ``engine``: the engine whose ``global_samples`` and
    ``global_steps`` it reads."""

    def __init__(self, engine):
        self._engine = engine
        self._start = time.perf_counter()
        self.epoch_count = 0
        self.micro_step_count = 0

    @property
    def global_step_count(self) -> int:
        return self._engine.global_steps

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def avg_samples_per_sec(self) -> float:
        seconds = time.perf_counter() - self._start
        return self._engine.global_samples / seconds if seconds > 0 else 0.0
