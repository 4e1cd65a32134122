"""``deepspeed.ops``: DeepSpeed's optimizers as scripts construct them (``adam``, ``lion``,
``adagrad``), without a CUDA build. DeepSpeed's other ops (fused transformer kernels, quantizers)
are not offered."""
from . import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
