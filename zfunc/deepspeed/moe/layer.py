"""``deepspeed.moe.layer.MoE``, refused: zfunc has no mixture-of-experts layer or expert parallelism."""
from __future__ import annotations

__all__ = ["MoE"]


class MoE:
    """Refused: see the module docstring."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.moe.layer.MoE: DeepSpeed's mixture of experts (gating, expert "
                                  "parallelism) is not supported by zfunc; use a dense layer, or a Hugging Face "
                                  "MoE model's own layers (their experts are ordinary parameters to zfunc)")
