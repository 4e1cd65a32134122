"""``deepspeed.runtime``: the modules of DeepSpeed's runtime that scripts import, on zfunc:
``engine``, ``config``, ``lr_schedules``, ``utils``, ``zero`` (``partition_parameters``,
``offload_config``), ``activation_checkpointing``, ``dataloader``, ``base_optimizer``."""
from . import activation_checkpointing, base_optimizer, config, dataloader, engine, lr_schedules, utils, zero

__all__ = ["activation_checkpointing", "base_optimizer", "config", "dataloader", "engine", "lr_schedules", "utils",
           "zero"]
