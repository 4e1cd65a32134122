"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save``. DeepSpeed's universal
checkpoints are not offered: zfunc's checkpoints load at any world size (docs/engine.md#checkpoints);
``deepspeed.utils.zero_to_fp32`` reads their fp32 weights."""
from . import utils

__all__ = ["utils"]
