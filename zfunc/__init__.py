"""zfunc: ZeRO as composable transforms of pure training steps.

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    state, metrics = step(state, batch)

This file is the map of the library: everything public is imported here.
"""
from . import checkpoint, dist, optim, schedules, swap, testing
from .accumulate import accumulate
from .coordinator import OrderChangedWarning, RankUnresponsiveError, RanksDivergedError
from .engine import Engine, RepeatingLoader
from .initialize import initialize
from .pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from .grad import apply, grad, value_and_grad
from .loss_scale import LossScaler
from .offload import offload_cpu
from .offload_nvme import offload_nvme
from .placement import Placement
from .precision import mixed_precision
from .state import State, gather_params, memory_report
from .step import Step, eval_step, train_step
from .step import set_units as units
from .tree import Params
from .zero import zero1, zero2, zero3

__all__ = [
    "Engine", "LayerSpec", "LossScaler", "PipelineModule", "TiedLayerSpec", "OrderChangedWarning", "RepeatingLoader", "initialize", "Placement", "RanksDivergedError", "RankUnresponsiveError", "State", "Step", "Params", "accumulate", "apply", "checkpoint", "dist", "eval_step",
    "gather_params", "grad", "memory_report", "mixed_precision", "offload_cpu", "offload_nvme", "optim", "swap", "testing", "train_step", "units",
    "value_and_grad", "zero1", "zero2", "zero3",
]
