"""``deepspeed.runtime.config``: ``DeepSpeedConfig``, a DeepSpeed config read by zfunc's parser
(zfunc.engine.config: every key checked, what zfunc lacks refused by name), with the attributes
scripts read off DeepSpeed's."""
from __future__ import annotations

from ... import dist
from ...engine import config as configuration

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]


class DeepSpeedConfigError(ValueError):
    """A config DeepSpeed would reject."""


class DeepSpeedConfig:
    """``DeepSpeedConfig(config, mpu=None)``: ``config`` a dict or the path of a JSON file, read for
    this process group's world size. ``parsed`` is zfunc's record (zfunc.engine.config.Config)."""

    def __init__(self, config, mpu=None, mesh_device=None):
        if mpu is not None or mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mpu= / mesh_device=): model and sequence parallelism are not "
                                      "supported; zfunc shards over data-parallel ranks")
        try:
            self.parsed = configuration.parse(config, dist.world_size())
        except ValueError as e:
            raise DeepSpeedConfigError(str(e)) from None
        c = self.parsed
        self._param_dict = c.raw
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.micro_batch_size
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.gradient_clipping = c.gradient_clipping
        self.zero_optimization_stage = c.zero.stage
        self.zero_enabled = c.zero.stage > 0
        self.fp16_enabled = c.fp16 is not None and c.fp16.enabled
        self.bfloat16_enabled = c.bf16 is not None and c.bf16.enabled
        self.steps_per_print = c.steps_per_print
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.optimizer_name = None if c.optimizer is None else c.optimizer.type
        self.scheduler_name = None if c.scheduler is None else c.scheduler.get("type")
