"""``deepspeed.checkpointing``: activation checkpointing as DeepSpeed scripts call it.

``checkpoint(function, *args)`` recomputes ``function``'s activations in backward instead of
keeping them: torch's ``torch.utils.checkpoint.checkpoint`` (non-reentrant, the RNG state kept, so
dropout draws the same mask twice), the same values and gradients as without it.
``configure(...)`` takes DeepSpeed's arguments: those that only say where the kept inputs live
(``partition_activations``, ``contiguous_checkpointing``, ``checkpoint_in_cpu``, ``synchronize``,
``profile``, ``num_checkpoints``) change no number and are recorded; model parallelism (``mpu_``)
is refused, named.
"""
from __future__ import annotations

import torch.utils.checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "reset"]

_settings: dict | None = None


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Record DeepSpeed's activation-checkpointing settings (see the module docstring)."""
    global _settings
    if mpu_ is not None:
        raise NotImplementedError("deepspeed.checkpointing.configure(mpu_=...): model parallelism (partitioning "
                                  "activations over tensor-parallel ranks) is not supported; pass mpu_=None")
    _settings = dict(deepspeed_config=deepspeed_config, partition_activations=partition_activations,
                     contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                     checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile)


def is_configured() -> bool:
    return _settings is not None


def reset() -> None:
    """Nothing is kept between checkpoints here (DeepSpeed frees its contiguous buffers)."""


def checkpoint(function, *args):
    """``function(*args)``, its activations recomputed in backward (see the module docstring)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
