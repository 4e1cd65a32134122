"""DeepSpeed's engine methods that read the config, the process group and the last step, shared by
both engines (zfunc.engine.engine, zfunc.pipeline.interpreter through ``Loop``).

They are methods where DeepSpeed's ``DeepSpeedEngine`` has methods (``train_batch_size()``,
``gradient_accumulation_steps()``, ``zero_optimization_stage()``...) and attributes where it has
attributes (``global_rank``, ``world_size``, ``dp_world_size``, ``local_rank``, ``device``), with
DeepSpeed 0.19's values for the same config, so a script written for DeepSpeed reads them
unchanged. A subclass sets ``config`` (zfunc.engine.config.Config), ``state``, ``step_fn`` and
``last_metrics``, and ``_step_applied``.
"""
from __future__ import annotations

import os

import torch

from .. import dist


class DeepSpeedMethods:
    """See the module docstring."""

    # ------------------------------------------------------------ the batch

    def train_batch_size(self) -> int:
        """Samples per update over every data-parallel rank (DeepSpeed's)."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one rank (DeepSpeed's)."""
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per update (DeepSpeed's)."""
        return self.config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    # ------------------------------------------------------------- the config

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage (1 to 3) is on."""
        return self.config.zero.stage > 0

    def zero_optimization_partition_weights(self) -> bool:
        """Whether parameters are sharded (stage 3)."""
        return self.config.zero.stage == 3

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` section (its ``device``, ``nvme_path``...), None when absent."""
        return self.config.zero.offload_optimizer

    def zero_offload_param(self):
        """The ``offload_param`` section, None when absent."""
        return self.config.zero.offload_param

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer's state lives in host memory (``offload_optimizer.device`` "cpu")."""
        section = self.config.zero.offload_optimizer
        return section is not None and section.device == "cpu"

    def fp16_enabled(self) -> bool:
        return self.config.fp16 is not None and self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16 is not None and self.config.bf16.enabled

    def loss_scale(self) -> float:
        """The config's static fp16 loss scale, 0 for dynamic scaling (DeepSpeed's ``loss_scale()``;
        the scale a step used is ``metrics["loss_scale"]``, ``engine.last_metrics``)."""
        return self.config.fp16.loss_scale if self.config.fp16 is not None else 0.0

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale() == 0

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def optimizer_name(self) -> str | None:
        """The config's ``optimizer.type`` as given, None without the section (a client optimizer)."""
        section = self.config.raw.get("optimizer")
        return section.get("type") if isinstance(section, dict) else None

    def optimizer_params(self) -> dict | None:
        section = self.config.raw.get("optimizer")
        return section.get("params") if isinstance(section, dict) else None

    def scheduler_name(self) -> str | None:
        return (self.config.scheduler or {}).get("type")

    def scheduler_params(self) -> dict | None:
        return (self.config.scheduler or {}).get("params")

    def get_mom(self) -> list:
        """Adam's ``betas`` (SGD's ``momentum``) per param group, as DeepSpeed's ``get_mom``."""
        o = self.config.optimizer
        if o is None:
            return []
        return [o.momentum] if o.type == "sgd" else [o.betas]

    # ----------------------------------------------------------- the ranks

    @property
    def global_rank(self) -> int:
        return dist.rank()

    @property
    def world_size(self) -> int:
        return dist.world_size()

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks (the world, or a pipeline's replicas of a stage)."""
        return self.config.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` from the launcher's environment (torchrun's, DeepSpeed's); without one,
        the global rank (one machine)."""
        return int(os.environ.get("LOCAL_RANK", self.global_rank))

    @property
    def device(self) -> torch.device:
        """Where the model computes: the state's device (``cpu`` on a CPU machine, ``cuda:N`` on a GPU)."""
        return dist.compute_device(self.step_fn.group)

    # ------------------------------------------------------------ the step

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the parameters: False between accumulation
        boundaries and for a step fp16's overflow (or a non-finite gradient) skipped."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global norm of the last update's gradients, unscaled, before clipping (None before
        the first update)."""
        norm = self.last_metrics.get("grad_norm")
        return None if norm is None else float(norm)

    @property
    def skipped_steps(self) -> int:
        """Steps fp16's overflow skipped so far."""
        return int(self.last_metrics.get("skipped_steps", 0))
