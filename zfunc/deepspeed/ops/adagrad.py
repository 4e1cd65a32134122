"""``deepspeed.ops.adagrad``: DeepSpeed's CPU Adagrad, refused by name: zfunc has no Adagrad."""
from __future__ import annotations

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad:
    """Refused: see the module docstring."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.ops.adagrad.DeepSpeedCPUAdagrad: DeepSpeed's Adagrad optimizer is not "
                                  "supported by zfunc (no Adagrad update); use Adam or AdamW "
                                  "(deepspeed.ops.adam.DeepSpeedCPUAdam with offload_optimizer, or torch.optim.AdamW)")
