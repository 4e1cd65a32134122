"""``zf.initialize``: the engine a DeepSpeed-style config asks for, above both engines."""
from __future__ import annotations

from typing import Callable

from torch import nn

from .engine import config as configuration
from . import dist
from .engine.engine import Engine
from .pipeline.module import PipelineModule
from .pipeline.interpreter import PipelineEngine


def initialize(model: nn.Module, config, *, loss_fn: Callable | None = None, optimizer=None,
               lr_scheduler: Callable | None = None, model_parameters=None, weights=None,
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
        cfg = configuration.parse(config, dist.world_size() // model.num_stages or 1)
        configuration.warn_ignored(cfg)
        return PipelineEngine(model, cfg, optimizer=optimizer, lr_scheduler=lr_scheduler)
    cfg = configuration.parse(config, dist.world_size())
    configuration.warn_ignored(cfg)
    return Engine(model, cfg, loss_fn=loss_fn, optimizer=optimizer, lr_scheduler=lr_scheduler, weights=weights,
                  strict=strict)
