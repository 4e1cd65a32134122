"""zfunc: ZeRO as composable transforms of pure training steps.

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    state, metrics = step(state, batch)

This file is the map of the library: everything public is imported here, and ``zf.initialize``
(as ``deepspeed.initialize`` is) is defined here, above both engines it picks from.
"""
import importlib as _importlib
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
import warnings as _warnings
from typing import Callable as _Callable

from torch import nn as _nn

from . import checkpoint, dist, optim, pipeline, swap, testing
from .compiled import CompileError, CompileWarning, GraphBreakWarning
from .coordinator import OrderChangedWarning, RankUnresponsiveError, RanksDivergedError
from .checkpoint import iter_weights
from .engine import Engine, RepeatingLoader
from .engine import config as _configuration
from .estimate import estimate
from .pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from .grad import apply, grad, value_and_grad
from .placement import Placement
from .residency import OffloadedState, StateOffloaded, bind, offload_states, reload_states
from .state import State, gather_params, memory_report
from .step import Step, eval_step, train_step
from .step import set_units as units
from .transforms.offload.plan import OffloadPlan
from .transforms.offload.rates import Rates
from .transforms import (LossScaler, accumulate, jit, mixed_precision, offload_cpu, offload_nvme, plan_offload, zero1,
                         zero2, zero3)
from .tree import Params, UpdateFailed, compile_units

__all__ = [
    "CompileError", "CompileWarning", "Engine", "GraphBreakWarning", "LayerSpec", "LossScaler", "OffloadPlan", "PipelineModule", "Rates", "TiedLayerSpec", "OrderChangedWarning", "RepeatingLoader", "initialize", "Placement", "RanksDivergedError", "RankUnresponsiveError", "State", "Step", "Params", "UpdateFailed", "accumulate", "apply", "bind", "checkpoint", "compile_units", "dist", "estimate", "eval_step",
    "gather_params", "grad", "iter_weights", "jit", "memory_report", "mixed_precision", "offload_cpu", "offload_nvme", "offload_states", "OffloadedState", "StateOffloaded", "reload_states", "optim", "pipeline", "plan_offload", "swap", "testing", "train_step", "units",
    "value_and_grad", "zero1", "zero2", "zero3",
]


def initialize(model: _nn.Module, config, *, loss_fn: _Callable | None = None, optimizer=None,
               lr_scheduler: _Callable | None = None, model_parameters=None, weights=None,
               strict: bool = True) -> Engine:
    """An ``Engine`` for ``model`` from a DeepSpeed-style ``config`` (a dict or a JSON path).

    ``loss_fn(model, batch)``: see ``zfunc.engine.engine.model_loss``. ``optimizer``: a zfunc optimizer
    (``zf.optim.adamw(...)``) instead of the config's ``optimizer`` section;
    ``lr_scheduler``: a schedule ``step -> lr`` for the config's optimizer.
    ``model_parameters`` is accepted for DeepSpeed's signature and ignored (every
    parameter that requires grad is trained). Keys that zfunc accepts but does not
    act on are listed in one warning. ``weights``, ``strict``: pretrained weights read into the
    state (``step.init(model, weights=PATH)``: a safetensors checkpoint ``save_pretrained``
    wrote; the model may be built on the meta device).
    """
    dist.init()
    dist.check_launch()
    if isinstance(model, PipelineModule):
        if loss_fn is not None:
            raise ValueError("a PipelineModule has its own loss_fn: give it there, not to zf.initialize")
        if weights is not None:
            raise NotImplementedError("weights= is not supported for a PipelineModule yet: each stage builds its "
                                      "own layers, whose names are not the checkpoint's")
        # the batch keys count data-parallel replicas: W / stages of them
        cfg = _configuration.parse(config, dist.world_size() // model.num_stages or 1)
        _configuration.warn_ignored(cfg)
        return pipeline.PipelineEngine(model, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler)
    cfg = _configuration.parse(config, dist.world_size())
    _configuration.warn_ignored(cfg)
    return Engine(model, cfg, loss_fn=loss_fn, optimizer=optimizer, lr_scheduler=lr_scheduler, weights=weights,
                  strict=strict)


def __getattr__(name: str):
    if name == "schedules":  # the pipeline's instruction lists; "schedule" alone also means an lr schedule
        _warnings.warn("zf.schedules is now zf.pipeline.schedules (zf.optim.lr holds the lr schedules); "
                       "the old name will go", FutureWarning, stacklevel=2)
        return pipeline.schedules
    raise AttributeError(f"module 'zfunc' has no attribute {name!r}")


_MOVED = {"zfunc.rates": "zfunc.transforms.offload.rates", "zfunc.offload_plan": "zfunc.transforms.offload.plan"}


class _MovedModules(_abc.MetaPathFinder, _abc.Loader):
    """``import zfunc.rates`` (and the other old paths in ``_MOVED``) still works, with a warning."""

    def find_spec(self, name, path=None, target=None):
        return _util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        _warnings.warn(f"{spec.name} is now {_MOVED[spec.name]}; the old path will go", FutureWarning, stacklevel=2)
        return _importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        """Nothing to run: ``create_module`` returned the new module, already imported."""


_sys.meta_path.append(_MovedModules())
