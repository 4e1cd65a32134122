"""``deepspeed.initialize`` on zfunc: the config read as ``zf.initialize`` reads it, the script's own
optimizer and scheduler read into zfunc's (zfunc.deepspeed.client), and DeepSpeed's four values
back: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

The engine is zfunc's ``Engine`` (zfunc.engine.engine) with DeepSpeed's methods
(zfunc.deepspeed.engine: its load keeps the RNG as DeepSpeed's does); the optimizer
and scheduler are its views (zfunc.engine.handles); the loader is DeepSpeed's
(zfunc.deepspeed.data). Where the optimizer comes from follows DeepSpeed's rules: the script's
``optimizer`` (a torch optimizer, or a callable ``model_parameters -> optimizer``) over the
config's ``optimizer`` section; the script's ``lr_scheduler`` (an object built on that optimizer,
or a callable ``optimizer -> scheduler``) over the config's ``scheduler`` section.
``model_parameters`` are the parameters the config's optimizer trains: all of the model's
trainable ones, or param groups (dicts with their own hyperparameters), which are then read
as a torch optimizer of the config's type would hold them.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

from .. import dist
from ..engine import RepeatingLoader
from ..engine.handles import LiveLr, OptimizerHandle, SchedulerHandle
from ..optim import Optimizer, lr as lr_schedules
from ..optim.base import EmptyState
from ..initialization import config_for, engine_for
from ..pipeline import PipelineModule
from . import zero
from .comm import init_distributed
from .data import DataLoader
from .engine import DeepSpeedEngine
from .utils.timer import ThroughputTimer


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required: bool | None = None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``
    (the loader None without ``training_data``, the scheduler None without one); see the module
    docstring. The config: ``config`` (or ``config_params``), else ``args.deepspeed_config``. What
    zfunc does not have raises naming it: ``mpu`` (model parallelism), ``mesh_param``."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None:
        raise NotImplementedError("initialize(mpu=...): model parallelism (Megatron's tensor / pipeline parallel "
                                  "groups, or accelerate's DeepSpeed Ulysses sequence parallelism, sp_size > 1) is not "
                                  "supported; zfunc shards over data-parallel ranks: use ZeRO-3")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...): sequence parallelism over a device mesh is not supported")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    dist.check_launch()
    raw = _config(args, config, config_params)
    if args is not None and hasattr(args, "local_rank"):  # DeepSpeed's engine sets it from the launcher's LOCAL_RANK
        args.local_rank = int(os.environ.get("LOCAL_RANK", dist.rank()))
    if isinstance(model, nn.Module):
        zero.unspill(model)  # a ZeRO-3 Init's placeholders in their full shapes (the config and engine read them)
    cfg = config_for(model, raw)
    if isinstance(model, PipelineModule):
        return _pipeline(model, cfg, optimizer, lr_scheduler, training_data, collate_fn)
    zopt, schedule, scheduler_kind, groups, group_schedules = _optimizer_and_schedule(
        cfg, model, optimizer, model_parameters, lr_scheduler)
    if zopt is not None and cfg.optimizer is not None:  # DeepSpeed: the script's optimizer over the config's
        cfg = dataclasses.replace(cfg, optimizer=None)
    if zopt is None and cfg.optimizer is None and schedule is None:
        zopt = _forward_only()
    engine = engine_for(model, cfg, engine_class=DeepSpeedEngine, optimizer=zopt, lr_scheduler=schedule)
    engine.group_schedules = group_schedules
    if groups is not None:
        live = group_schedules is not None and all(isinstance(s, LiveLr) for s in group_schedules)
        engine.optimizer = OptimizerHandle(engine, groups, live=groups if live else None)
    if scheduler_kind is not None:
        engine.lr_scheduler = SchedulerHandle(engine, scheduler_kind)
    zero.register_engine(engine)
    loader = None
    if training_data is not None:
        loader = DataLoader(training_data, cfg.micro_batch_size, rank=dist.rank(), world=dist.world_size(),
                            collate_fn=collate_fn, drop_last=bool(raw.get("dataloader_drop_last", False)))
    engine.training_dataloader = loader
    engine.tput_timer = ThroughputTimer(engine)  # DeepSpeed's engine attribute (zfunc.deepspeed.utils.timer)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _forward_only() -> Optimizer:
    """The optimizer of an engine made without one (none in the config nor the call: TRL's reference
    model, transformers' evaluation-only engine): DeepSpeed makes such an engine for forward passes,
    and so does zfunc, with no state for it (``forward_only``: no fp32 master copy under bf16 or
    fp16 either); an update raises, naming why."""
    def init(params):
        return EmptyState()

    def update(*args, **kwargs):
        raise RuntimeError("this engine was made without an optimizer (deepspeed.initialize with no 'optimizer' in "
                           "the config and none passed), so it runs forward passes only: give it an optimizer to "
                           "train it")
    init.forward_only = True
    return Optimizer(init, update, fuses=True)


# ------------------------------------------------------------------------------ the config


def _config(args, config, config_params) -> dict:
    """The config dict from ``config`` / ``config_params`` / ``args.deepspeed_config``, as DeepSpeed picks."""
    if config is None and config_params is not None:
        config = config_params
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        if getattr(args, "deepspeed_config", None) is not None:
            raise ValueError("args has both deepscale_config and deepspeed_config; give --deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config is given both as args.deepspeed_config and as config=: keep one")
        config = from_args
    if config is None:
        raise ValueError("no DeepSpeed config: pass --deepspeed_config FILE (with add_config_arguments) or config=")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"DeepSpeed config file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"DeepSpeed config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")
    return config


# ----------------------------------------------------------------- optimizer and schedule


def _client():
    try:
        from . import client
    except ImportError as e:  # helper C's module: the script's optimizer and scheduler read into zfunc's
        raise NotImplementedError(f"a client optimizer or lr_scheduler needs zfunc.deepspeed.client ({e})") from None
    return client


def _optimizer_and_schedule(cfg, model, optimizer, model_parameters, lr_scheduler):
    """``(zfunc optimizer or None: the config's, schedule or None, the scheduler view's kind or
    None: the engine's default, the param groups' hyperparameters or None, each group's lr
    schedule or None)``."""
    if isinstance(optimizer, Optimizer):  # already zfunc's
        return optimizer, None, None, None, None
    if model_parameters is not None:  # often a generator (filter(...)): read once
        model_parameters = list(model_parameters)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch optimizer or a callable model_parameters -> optimizer, got "
                            f"{type(optimizer).__name__}")
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = optimizer(params)
    elif optimizer is None and cfg.optimizer is not None and _custom_parameters(model, model_parameters):
        optimizer = _config_optimizer_over(cfg.optimizer, model_parameters)  # param groups of the config's optimizer
    if optimizer is None:  # the config's optimizer
        if lr_scheduler is None:
            return None, None, None, None, None
        if cfg.optimizer is None:
            raise ValueError("lr_scheduler without an optimizer: put an 'optimizer' section in the config or pass "
                             "optimizer=")
        if cfg.scheduler is not None:
            raise ValueError("a scheduler is given both in the config ('scheduler') and as lr_scheduler=: keep one")
        schedule = _client().schedule_from_client(lr_scheduler, cfg.optimizer.lr)
        return None, schedule, "torch", None, None
    if lr_scheduler is None and cfg.scheduler is not None:  # the config's scheduler, built on the script's optimizer
        lr_scheduler = _ConfigScheduler(optimizer, cfg.scheduler)
    client = _client()
    if lr_scheduler is not None:  # each group's lr as the scheduler sets it (read off copies before any step)
        group_schedules = [client.schedule_from_client(lr_scheduler, optimizer, group=k)
                           for k in range(len(optimizer.param_groups))]
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]
    live = None
    if lr_scheduler is None:  # the lr is what the script's optimizer's own groups hold, as under DeepSpeed (whose
        # optimizer keeps those dicts): a scheduler built on it (Accelerate) or on the returned optimizer (the
        # Trainer), which shows the same groups, sets it
        groups = optimizer.param_groups
        group_schedules = live = [LiveLr(groups, k) for k in range(len(groups))]
    zopt = client.optimizer_from_client(optimizer, model, lr_scheduler=lr_scheduler, live_lrs=live)
    kind = None
    if lr_scheduler is not None:
        kind = "deepspeed" if isinstance(lr_scheduler, _ConfigScheduler) else "torch"
    return zopt, None, kind, groups, group_schedules


def _custom_parameters(model, model_parameters) -> bool:
    """Whether ``model_parameters`` are other than all the model's trainable parameters (param
    groups, or a subset)."""
    if model_parameters is None:
        return False
    if any(isinstance(p, dict) for p in model_parameters):
        return True
    mine = {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in model_parameters} != mine


def _config_optimizer_over(o, model_parameters):
    """The torch optimizer of the config's section over ``model_parameters`` (param groups), as
    DeepSpeed builds its own: AdamW for decoupled decay, else Adam, or SGD."""
    groups = model_parameters
    if o.type == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, dampening=o.dampening,
                               weight_decay=o.weight_decay, nesterov=o.nesterov)
    cls = torch.optim.AdamW if o.decoupled else torch.optim.Adam
    return cls(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


class _ConfigScheduler:
    """The config's ``scheduler`` section on the script's optimizer, as DeepSpeed builds it: each
    param group's lr set to the schedule's value (WarmupCosineLR: the cosine's ratio times the
    group's own lr, as DeepSpeed's scales each group's initial lr; the others: one value for
    every group), stepped once per update (what zfunc.deepspeed.client reads off a copy of it)."""

    def __init__(self, optimizer, section):
        self.optimizer = optimizer
        initial = [float(g["lr"]) for g in optimizer.param_groups]
        if section.get("type") == "WarmupCosineLR":
            self.schedules = [lr_schedules.from_config(section, lr) for lr in initial]
        else:
            self.schedules = [lr_schedules.from_config(section, initial[0])] * len(initial)
        self.last_batch_iteration = -1
        self._set(0)

    def _set(self, count: int) -> None:
        for g, schedule in zip(self.optimizer.param_groups, self.schedules):
            g["lr"] = schedule(count)

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._set(self.last_batch_iteration + 1)


# ------------------------------------------------------------------------------ pipeline


def _pipeline(model, cfg, optimizer, lr_scheduler, training_data, collate_fn):
    if optimizer is not None or lr_scheduler is not None:
        raise NotImplementedError("a client optimizer or lr_scheduler with a PipelineModule is not supported yet: "
                                  "give them in the config")
    engine = engine_for(model, cfg)
    engine.optimizer = OptimizerHandle(engine)
    engine.lr_scheduler = SchedulerHandle(engine) if engine.lr_schedule is not None else None
    engine.training_dataloader = None
    if training_data is not None:  # as DeepSpeed's pipeline engine: in order, each replica its share, repeating
        loader = DataLoader(training_data, cfg.micro_batch_size, rank=engine.grid.replica, world=engine.grid.replicas,
                            collate_fn=collate_fn, drop_last=bool(cfg.raw.get("dataloader_drop_last", False)),
                            shuffle=False)
        engine.set_dataloader(RepeatingLoader(loader))
    engine.tput_timer = ThroughputTimer(engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
