"""A DeepSpeed-style config as zfunc objects: the optimizer with its schedule, and the step
transforms a user would write by hand, in the order zfunc's rules ask::

    jit(zeroN(offload_*(mixed_precision(accumulate(train_step(loss, chain(clip, optimizer)), gas)))))

(``jit`` only under ``compile.deepcompile``), and the compiled blocks of ``compile.enabled``
and ``engine.compile``. Both engines (zfunc.engine.engine, zfunc.pipeline.interpreter) build
their steps here.
"""
from __future__ import annotations

import importlib
import warnings

import torch
from torch import nn

from ..optim import lr as lr_schedules
from ..optim.reported_lr import next_lr, update_count
from .. import compiled, dist, optim
from ..transforms.accumulate import accumulate
from .config import OffloadParamConfig
from ..transforms.loss_scale import LossScaler
from ..transforms.offload.cpu import offload_cpu
from ..transforms.offload.nvme import offload_nvme
from ..transforms.precision import mixed_precision
from ..step import EvalStep, Step
from ..transforms.jit import jit
from ..transforms.zero import zero1, zero2, zero3
from ..ops._names import unknown
from ..tree import compile_units, unit_modules
from . import config as configuration


def build_optimizer(cfg, optimizer, lr_scheduler, model=None):
    """The optimizer the config (or the caller) asks for, with its schedule and clipping; ``model``:
    whose parameters Muon takes (``muon_labels``)."""
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError("an optimizer is given both in the config ('optimizer') and to zf.initialize: keep one")
    if optimizer is not None and lr_scheduler is not None:
        raise ValueError("with your own optimizer, give it the schedule as its lr (zf.optim.adamw(schedule)) "
                         "instead of passing lr_scheduler")
    if optimizer is None and cfg.optimizer is None:
        raise ValueError("no optimizer: put an 'optimizer' section in the config or pass optimizer=zf.optim.adamw(...)")
    schedule = None
    if optimizer is None:
        o = cfg.optimizer
        base_lr = o.lr
        if lr_scheduler is not None and cfg.scheduler is not None:
            raise ValueError("a scheduler is given both in the config ('scheduler') and to zf.initialize: keep one")
        if lr_scheduler is not None:
            schedule = lr_scheduler
        elif cfg.scheduler is not None:
            schedule = lr_schedules.from_config(cfg.scheduler, base_lr)
        lr = schedule if schedule is not None else base_lr
        if o.type == "muon":
            optimizer = optim.multi({"muon": optim.muon(lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                                         nesterov=o.nesterov, ns_steps=o.ns_steps,
                                                         adjust_lr_fn=o.adjust_lr_fn),
                                     "adamw": optim.adamw(lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)},
                                    muon_labels(model))
        elif o.type == "sgd":
            optimizer = optim.sgd(lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov,
                                  dampening=o.dampening)
        elif o.decoupled:
            optimizer = optim.adamw(lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        else:
            optimizer = optim.adam(lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if cfg.gradient_clipping > 0:
        optimizer = optim.chain(optim.clip_by_global_norm(cfg.gradient_clipping), optimizer)
    return optimizer, schedule


def muon_labels(model) -> dict[str, str]:
    """DeepSpeed's split for its Muon: a parameter's own ``use_muon`` if set, else every 2-D parameter
    (DeepSpeed's ``set_optimizer_flags``); the rest, and any a flag gives Muon but is not 2-D, AdamW."""
    if model is None:
        raise ValueError("optimizer.type 'Muon' needs the model, to say which parameters Muon updates")
    return {name: "muon" if p.dim() == 2 and getattr(p, "use_muon", True) else "adamw"
            for name, p in compiled.named_parameters(model, remove_duplicate=False)}


def current_lr(cfg, schedule, state, optimizer=None) -> list[float]:
    """The learning rate of the next update (DeepSpeed's ``get_lr``: one per param group): the
    schedule at the optimizer's update count, which a skipped step does not advance
    (zfunc.optim.reported_lr). Without a schedule, the config's lr, else the one ``optimizer``
    (a caller's zfunc optimizer) carries as its ``lr``."""
    if schedule is None:
        if cfg.optimizer is not None:
            return [cfg.optimizer.lr]
        lr = next_lr(optimizer, state.opt_state) if optimizer is not None else None
        return [] if lr is None else [lr]
    count = update_count(state.opt_state)
    return [float(schedule(int(state.count) if count is None else count))]


def compose(cfg, base: Step, *, group=None, accumulate_micro: bool = True,
            jit_kwargs: dict | None = None) -> Step:
    """``base`` wrapped as the config says, in the order zfunc's rules ask (README, docs/architecture.md).

    ``group``: the ZeRO stage's process group (a pipeline stage's data-parallel group);
    ``accumulate_micro``: wrap in ``accumulate`` (not for a pipeline stage, whose schedule
    takes the micro-batches one by one). Under ``compile.deepcompile`` a training step is
    wrapped in ``zf.jit`` last, given ``jit_kwargs`` (``torch.compile``'s arguments; default:
    the section's ``backend`` and ``kwargs``)."""
    c = cfg.compile
    if c is not None and c.deepcompile and not accumulate_micro:
        raise ValueError("'compile.deepcompile' = true with a PipelineModule: a stage's step is driven by its "
                         "schedule, one micro-batch at a time, not traced whole; compile its layers instead "
                         "('compile': {'enabled': true}, or engine.compile())")
    step = base
    if cfg.gradient_accumulation_steps > 1 and accumulate_micro and not isinstance(base, EvalStep):
        step = accumulate(step, cfg.gradient_accumulation_steps)
    if cfg.compute_dtype == torch.bfloat16:
        step = mixed_precision(step, torch.bfloat16)
    elif cfg.compute_dtype == torch.float16:
        f = cfg.fp16
        scaler = (LossScaler(init_scale=2.0 ** f.initial_scale_power, window=f.loss_scale_window,
                             hysteresis=f.hysteresis, min_scale=f.min_loss_scale,
                             consecutive_hysteresis=f.consecutive_hysteresis)
                  if not f.loss_scale else LossScaler(init_scale=f.loss_scale, dynamic=False))
        step = mixed_precision(step, torch.float16, loss_scale=scaler)
    z = cfg.zero
    coordinator = dict(prefetch_bucket_size=z.stage3_prefetch_bucket_size, max_live_parameters=z.stage3_max_live_parameters,
                       max_reuse_distance=z.stage3_max_reuse_distance)
    param_dev = z.offload_param.device if z.offload_param is not None else "none"
    opt_dev = z.offload_optimizer.device if z.offload_optimizer is not None else "none"
    if param_dev == "cpu" and opt_dev == "nvme":
        raise ValueError("zero_optimization.offload_param.device 'cpu' with offload_optimizer.device 'nvme' is not "
                         "supported yet: offload both to cpu, or both to nvme")
    if param_dev == "nvme" or opt_dev == "nvme":
        if c is not None and c.deepcompile and not isinstance(base, EvalStep):
            raise ValueError("'compile.deepcompile' = true with offload to nvme is not supported yet: swap files are no "
                             "tensors of one compiled program (zf.jit); compile the blocks instead ('compile': "
                             "{'enabled': true}, or engine.compile())")
        if param_dev == "nvme" and opt_dev not in ("nvme", "none"):
            raise ValueError(f"zero_optimization.offload_param.device 'nvme' with offload_optimizer.device "
                             f"{opt_dev!r} is not supported yet: offload both to nvme, or only the optimizer")
        section = z.offload_param if param_dev == "nvme" else z.offload_optimizer
        if param_dev == opt_dev == "nvme" and z.offload_param.nvme_path != z.offload_optimizer.nvme_path:
            raise ValueError(
                "zero_optimization.offload_param.nvme_path and offload_optimizer.nvme_path differ "
                f"({z.offload_param.nvme_path!r}, {z.offload_optimizer.nvme_path!r}): one state's swap files live "
                "in one folder here; give both the same path")
        pool = z.offload_param if z.offload_param is not None else OffloadParamConfig()
        step = offload_nvme(step, section.nvme_path, params=param_dev == "nvme", optimizer=opt_dev == "nvme",
                            buffer_count=pool.buffer_count, buffer_size=pool.buffer_size,
                            sub_group_size=z.sub_group_size, aio=cfg.aio,
                            **(coordinator if z.stage == 3 else {}))
    elif param_dev == "cpu":  # ZeRO-Infinity's CPU tier: shards on the host, so the optimizer runs there too
        step = offload_cpu(step, params=True, pin_memory=z.offload_param.pin_memory)
    elif opt_dev == "cpu":
        ratio = z.offload_optimizer.ratio  # DeepSpeed's Twin-Flow: the share updated on the host
        step = offload_cpu(step, pin_memory=z.offload_optimizer.pin_memory, ratio=None if ratio == 1.0 else ratio)
    mesh = _mics_mesh(z.mics_shard_size, group)
    if z.stage == 1:
        step = zero1(step, group=group, mesh=mesh)
    elif z.stage == 2:
        step = zero2(step, group=group, mesh=mesh)
    elif z.stage == 3:
        step = zero3(step, group=group, mesh=mesh, persistence_threshold=z.stage3_param_persistence_threshold,
                     reshard_after_forward=z.zero_hpz_partition_size if z.zero_hpz_partition_size > 1 else True,
                     **coordinator)
    elif group is not None:
        step = zero1(step, group=group)  # a pipeline stage's replicas still average their gradients there
    if c is not None and c.deepcompile and not isinstance(base, EvalStep):
        if jit_kwargs is None:
            jit_kwargs = {**c.kwargs, "backend": resolve_backend(c.backend, "compile.backend")}
        step = jit(step, **jit_kwargs)
    return step


_meshes: dict = {}


def _mics_mesh(shard_size: int, group):
    """MiCS's ``mics_shard_size`` as hybrid sharding's mesh (``zf.dist.mesh(shard=...)``: shard groups of
    consecutive ranks, as MiCS makes them), one per size in a process; None where it is off."""
    if shard_size <= 0:
        return None
    if group is not None:
        raise ValueError("zero_optimization.mics_shard_size with a PipelineModule is not supported yet: hybrid "
                         "sharding's mesh spans every rank, a pipeline stage's data-parallel group does not")
    if shard_size not in _meshes:
        _meshes[shard_size] = dist.mesh(shard=shard_size)
    return _meshes[shard_size]


# ------------------------------------------------------------------------ compiling


def resolve_backend(backend, where: str = "backend"):
    """A ``torch.compile`` backend as DeepSpeed takes one: a callable, a name dynamo knows
    (``"inductor"``, ``"aot_eager"``, ...), or the dotted path of a callable to import
    (``"my_pkg.my_backend"``). Raises ValueError naming ``where``."""
    if callable(backend):
        return backend
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"{where} must name a torch.compile backend or be a callable, got {backend!r}")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend in known:
        return backend
    if "." in backend:
        module, _, attr = backend.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{where} {backend!r}: cannot import it ({e})") from None
        if not callable(fn):
            raise ValueError(f"{where} {backend!r} is not callable")
        return fn
    raise ValueError(unknown(f"{where} {backend!r}", backend, sorted(known), label="torch.compile's backends",
                             cutoff=0.5) + "; or the dotted path of a backend function")


def compile_arguments(compile_kwargs: dict | None, backend, where: str = "compile_kwargs") -> dict:
    """``torch.compile``'s keyword arguments: ``compile_kwargs`` (checked against its signature)
    with ``backend`` (resolved). A ``backend`` inside ``compile_kwargs`` is overridden, with a
    warning, as DeepSpeed's ``engine.compile`` does."""
    kw = dict(compile_kwargs or {})
    if "backend" in kw:
        warnings.warn(f"the 'backend' in {where} is overridden by the backend argument ({backend!r}), as in "
                      "DeepSpeed: pass backend=... instead", UserWarning, stacklevel=3)
        del kw["backend"]
    valid = configuration.compile_kwarg_names()
    for key in kw:
        if key not in valid:
            raise ValueError(unknown(f"{where} key {key!r}", key, valid, label="torch.compile's"))
    return {**kw, "backend": resolve_backend(backend, "backend")}


def compile_blocks(model: nn.Module, kwargs: dict) -> list[str]:
    """Compile ``model``'s blocks in place with ``torch.compile``'s ``kwargs``: each unit of
    the engine's unit policy (``zf.compile_units``), or the whole model, in place, when it
    is one unit (no ``nn.ModuleList``). Returns the compiled modules' paths ("" for the root)."""
    paths = unit_modules(model, None)
    if paths:
        compile_units(model, **kwargs)
        return paths
    compiled.compile_in_place(model, **kwargs)
    return [""]
