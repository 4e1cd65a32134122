"""``deepspeed.compression``: ``helper.recursive_getattr`` / ``recursive_setattr`` (what
DeepSpeed-Chat's LoRA imports). DeepSpeed's compression (quantization-aware training, pruning,
``init_compression``) is not offered."""
from . import helper

__all__ = ["helper"]
