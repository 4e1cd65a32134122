"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save``. DeepSpeed's checkpoint
conversion tools (universal checkpoints, ``zero_to_fp32``) are not offered: zfunc's checkpoints
load at any world size (docs/engine.md#checkpoints)."""
from . import utils

__all__ = ["utils"]
