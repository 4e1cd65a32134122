"""``import zfunc.deepspeed as deepspeed``: what DeepSpeed training scripts call, on zfunc's engine.

``init_distributed``, ``add_config_arguments``, ``initialize`` (DeepSpeed's four values: the
engine, its optimizer and lr scheduler as scripts read them, the training data loader),
``comm`` (``get_rank``, ``get_world_size``, ``barrier``), ``zero.Init`` and
``zero.GatheredParameters``, ``get_accelerator()``, and the module tree scripts import
(``ops.adam``, ``pipe``, ``runtime.lr_schedules``, ``utils``, ``checkpointing``...).

``install()`` makes ``import deepspeed`` itself import this package, for scripts and libraries
(transformers, Accelerate) that are not edited; ``ZFUNC_AS_DEEPSPEED=1`` does it at interpreter
start (_zfunc_as_deepspeed). docs/deepspeed.md says what each name does here and what is refused.
"""
from _zfunc_as_deepspeed import install, installed, uninstall, version as _version

from . import accelerator, checkpoint, comm, compression, launcher, moe, ops, pipe, runtime, utils, zero
from ..engine import RepeatingLoader
from ..pipeline import PipelineEngine
from .accelerator import get_accelerator
from .arguments import add_config_arguments
from .comm import init_distributed
from .engine import DeepSpeedEngine
from .initialization import initialize
from .pipe import PipelineModule
from .runtime.activation_checkpointing import checkpointing
from .runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from .utils import log_dist, logger

__version__ = _version()
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("+")[0].split("."))

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine", "PipelineEngine", "PipelineModule",
           "RepeatingLoader", "__version__", "accelerator", "add_config_arguments", "checkpoint", "checkpointing",
           "comm", "compression", "get_accelerator", "init_distributed", "init_inference", "initialize", "install",
           "installed", "launcher", "log_dist", "logger", "moe", "ops", "pipe", "runtime", "uninstall", "utils", "zero"]


def init_inference(*args, **kwargs):
    """Refused: DeepSpeed-Inference (kernel injection, tensor-parallel inference) is not in zfunc."""
    raise NotImplementedError("deepspeed.init_inference: DeepSpeed-Inference (kernel injection, tensor-parallel "
                              "inference) is not supported by zfunc; run the trained model with plain PyTorch "
                              "(engine.module(...), or engine.save_16bit_model and load it)")
