"""``deepspeed.ops.lion``: DeepSpeed's Lion optimizers, refused by name: zfunc has no Lion."""
from __future__ import annotations

__all__ = ["DeepSpeedCPULion", "FusedLion"]


def _refuse(name: str):
    raise NotImplementedError(f"deepspeed.ops.lion.{name}: DeepSpeed's Lion optimizer is not supported by zfunc "
                              "(no Lion update); use Adam or AdamW (deepspeed.ops.adam.FusedAdam, torch.optim.AdamW, or "
                              "\"optimizer\": {\"type\": \"AdamW\"} in the config)")


class FusedLion:
    """Refused: see the module docstring."""

    def __init__(self, *args, **kwargs):
        _refuse("FusedLion")


class DeepSpeedCPULion:
    """Refused: see the module docstring."""

    def __init__(self, *args, **kwargs):
        _refuse("DeepSpeedCPULion")
