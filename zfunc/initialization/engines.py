"""The engine for a model: zfunc's ``Engine`` (or a subclass, as DeepSpeed's face has), or the
``PipelineEngine`` for a ``PipelineModule``, and the config parsed for the ranks that hold one copy
of the batch.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from .. import dist
from ..engine import Engine
from ..engine import config as configuration
from ..pipeline import PipelineEngine, PipelineModule


def config_for(model: nn.Module, config):
    """``config`` (a dict or a JSON path) parsed for ``model``: its batch keys count the data-parallel
    replicas, W / stages of them for a ``PipelineModule``. Keys zfunc accepts but does not act on
    are listed in one warning."""
    replicas = dist.world_size()
    if isinstance(model, PipelineModule):
        replicas = replicas // model.num_stages or 1
    cfg = configuration.parse(config, replicas)
    configuration.warn_ignored(cfg)
    return cfg


def engine_for(model: nn.Module, cfg, *, engine_class: type = Engine, loss_fn: Callable | None = None,
               optimizer=None, lr_scheduler: Callable | None = None, weights=None, strict: bool = True):
    """The engine that runs ``model`` under the parsed ``cfg``: ``engine_class`` for a model, the
    ``PipelineEngine`` for a ``PipelineModule`` (which has its own loss and builds its own layers)."""
    if isinstance(model, PipelineModule):
        if loss_fn is not None:
            raise ValueError("a PipelineModule has its own loss_fn: give it there, not to initialize")
        if weights is not None:
            raise NotImplementedError("weights= is not supported for a PipelineModule yet: each stage builds its "
                                      "own layers, whose names are not the checkpoint's")
        return PipelineEngine(model, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler)
    return engine_class(model, cfg, loss_fn=loss_fn, optimizer=optimizer, lr_scheduler=lr_scheduler, weights=weights,
                        strict=strict)


def initialize(model: nn.Module, config, *, loss_fn: Callable | None = None, optimizer=None,
               lr_scheduler: Callable | None = None, model_parameters=None, weights=None,
               strict: bool = True) -> Engine:
    """An ``Engine`` for ``model`` from a DeepSpeed-style ``config`` (a dict or a JSON path).

    ``loss_fn(model, batch)``: see ``zfunc.engine.engine.model_loss``. ``optimizer``: a zfunc optimizer
    (``zf.optim.adamw(...)``) instead of the config's ``optimizer`` section;
    ``lr_scheduler``: a schedule ``step -> lr`` for the config's optimizer.
    ``model_parameters`` is accepted for DeepSpeed's signature and ignored (every
    parameter that requires grad is trained). Keys that zfunc accepts but does not act on are
    listed in one warning. ``weights``, ``strict``: pretrained weights read into the state
    (``step.init(model, weights=PATH)``: a safetensors checkpoint ``save_pretrained`` wrote; the
    model may be built on the meta device).
    """
    dist.init()
    dist.check_launch()
    return engine_for(model, config_for(model, config), loss_fn=loss_fn, optimizer=optimizer,
                      lr_scheduler=lr_scheduler, weights=weights, strict=strict)
