"""zfunc: ZeRO as composable transforms of pure training steps.

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    state, metrics = step(state, batch)

This file is the map of the library: everything public is imported here.
"""
import warnings as _warnings

from . import checkpoint, dist, optim, pipeline, swap, testing
from .compiled import CompileError, CompileWarning, GraphBreakWarning
from .coordinator import OrderChangedWarning, RankUnresponsiveError, RanksDivergedError
from .engine import Engine, RepeatingLoader
from .initialize import initialize
from .pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from .grad import apply, grad, value_and_grad
from .placement import Placement
from .state import State, gather_params, memory_report
from .step import Step, eval_step, train_step
from .step import set_units as units
from .offload_plan import OffloadPlan
from .rates import Rates
from .transforms import (LossScaler, accumulate, jit, mixed_precision, offload_cpu, offload_nvme, plan_offload, zero1,
                         zero2, zero3)
from .tree import Params, UpdateFailed, compile_units

__all__ = [
    "CompileError", "CompileWarning", "Engine", "GraphBreakWarning", "LayerSpec", "LossScaler", "OffloadPlan", "PipelineModule", "Rates", "TiedLayerSpec", "OrderChangedWarning", "RepeatingLoader", "initialize", "Placement", "RanksDivergedError", "RankUnresponsiveError", "State", "Step", "Params", "UpdateFailed", "accumulate", "apply", "checkpoint", "compile_units", "dist", "eval_step",
    "gather_params", "grad", "jit", "memory_report", "mixed_precision", "offload_cpu", "offload_nvme", "optim", "pipeline", "plan_offload", "swap", "testing", "train_step", "units",
    "value_and_grad", "zero1", "zero2", "zero3",
]


def __getattr__(name: str):
    if name == "schedules":  # the pipeline's instruction lists; "schedule" alone also means an lr schedule
        _warnings.warn("zf.schedules is now zf.pipeline.schedules (zf.optim.lr holds the lr schedules); "
                       "the old name will go", FutureWarning, stacklevel=2)
        return pipeline.schedules
    raise AttributeError(f"module 'zfunc' has no attribute {name!r}")
