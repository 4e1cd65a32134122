"""zfunc: ZeRO as composable transforms of pure training steps.

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    state, metrics = step(state, batch)

This file is the map of the library: everything public is imported here, and nothing else is
(``zf.initialize`` lives in zfunc.initialization, the old import paths in zfunc.old_paths).
"""
from . import checkpoint, dist, optim, pipeline, swap, testing
from .compiled import CompileError, CompileWarning, GraphBreakWarning
from .coordinator import OrderChangedWarning, RankUnresponsiveError, RanksDivergedError
from .checkpoint import iter_weights
from .engine import Engine, RepeatingLoader
from .estimator import estimate
from .initialization import initialize
from .losses import chunked_cross_entropy
from .old_paths import install as _install_old_paths, old_attribute as __getattr__
from .pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from .grad import apply, grad, value_and_grad
from .placement import Placement
from .residency import OffloadedState, StateOffloaded, bind, offload_states, reload_states
from .state import State, gather_params, memory_report
from .step import Step, eval_step, train_step
from .step import set_units as units
from .transforms.offload.plan import OffloadPlan
from .transforms.offload.rates import Rates
from .transforms import (LossScaler, accumulate, jit, mixed_precision, offload_cpu, offload_nvme, plan_offload,
                         recompute, zero1, zero2, zero3)
from .tree import Params, UpdateFailed, compile_units

__all__ = [
    "CompileError", "CompileWarning", "Engine", "GraphBreakWarning", "LayerSpec", "LossScaler", "OffloadPlan", "PipelineModule", "Rates", "TiedLayerSpec", "OrderChangedWarning", "RepeatingLoader", "initialize", "Placement", "RanksDivergedError", "RankUnresponsiveError", "State", "Step", "Params", "UpdateFailed", "accumulate", "apply", "bind", "checkpoint", "chunked_cross_entropy", "compile_units", "dist", "estimate", "eval_step",
    "gather_params", "grad", "iter_weights", "jit", "memory_report", "mixed_precision", "offload_cpu", "offload_nvme", "offload_states", "OffloadedState", "StateOffloaded", "reload_states", "optim", "pipeline", "plan_offload", "recompute", "swap", "testing", "train_step", "units",
    "value_and_grad", "zero1", "zero2", "zero3",
]

_install_old_paths()  # zfunc.rates, zfunc.estimate, ...: their new homes, with a warning
