"""``deepspeed.runtime``: the modules of DeepSpeed's runtime that scripts import, on zfunc:
``engine``, ``config``, ``lr_schedules``, ``utils``, ``zero`` (``partition_parameters``),
``activation_checkpointing``, ``dataloader``."""
from . import activation_checkpointing, config, dataloader, engine, lr_schedules, utils, zero

__all__ = ["activation_checkpointing", "config", "dataloader", "engine", "lr_schedules", "utils", "zero"]
