"""``import zfunc.deepspeed as deepspeed``: what DeepSpeed training scripts call, on zfunc's engine.

``init_distributed``, ``add_config_arguments``, ``initialize`` (DeepSpeed's four values: the
engine, its optimizer and lr scheduler as scripts read them, the training data loader),
``comm`` (``get_rank``, ``get_world_size``, ``barrier``), ``zero.Init`` and
``zero.GatheredParameters``, ``accelerator.get_accelerator()``. docs/deepspeed.md says what each
does here and what is refused.
"""
from . import accelerator, comm, zero
from .arguments import add_config_arguments
from .comm import init_distributed
from .initialization import initialize
from ..engine import RepeatingLoader
from .engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "RepeatingLoader", "accelerator", "add_config_arguments", "comm", "init_distributed",
           "initialize", "zero"]
