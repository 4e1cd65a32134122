"""A DeepSpeed script's own optimizer and lr scheduler (``deepspeed.initialize(optimizer=,
lr_scheduler=)``), read into zfunc's: the same math, hyperparameters and param groups, and the
lr (and momentum) each update uses.

The optimizer: ``torch.optim.AdamW``, ``Adam``, ``SGD`` (those classes exactly: a subclass may
change ``step``) and DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam`` (by class name, so they
need not build), each param group mapped by the identity of its Parameter objects to the model's
names (``model.named_parameters()``) and given to ``zf.optim.group``. What has no counterpart in
zfunc (``amsgrad``, ``maximize``, Adam without bias correction) is refused naming the group and
the key; what only picks an implementation (``foreach``, ``fused``, ``capturable``,
``differentiable``) is ignored, as the math is the same. Any other ``torch.optim.Optimizer`` class
(``torch.optim.Muon``, ``Adafactor``, ``RMSprop``, a third-party one) runs as itself through
``zf.optim.from_torch``, each group's values as the class holds them (a scheduler's lr followed):
whole tensors, each parameter by one owner rank (docs/optim.md).

The scheduler: any object that, like ``torch.optim.lr_scheduler.LRScheduler`` and DeepSpeed's
``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, holds ``.optimizer`` and
writes its param groups in ``step()``, or a callable ``optimizer -> scheduler`` (as
``deepspeed.initialize`` takes). DeepSpeed's engine calls ``step()`` after each applied update, so
update ``k`` runs with the values the groups hold after ``k`` calls. zfunc reads them off a
private copy of the scheduler and its optimizer (the parameters shared, not copied), stepped as
far as the updates go and no further, so every scheduler is followed exactly without being
modelled. ``ReduceLROnPlateau`` is refused: its lr follows a metric, not the update count.
"""
from __future__ import annotations

import copy
import threading
import warnings
from typing import Any, Callable

import torch
from torch import nn

from .. import compiled, optim

ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
DEEPSPEED_ADAMS = ("FusedAdam", "DeepSpeedCPUAdam")
TORCH_SWITCHES = ("foreach", "differentiable", "capturable", "fused")  # how torch runs a class, not its math


def optimizer_from_client(optimizer: torch.optim.Optimizer, model: nn.Module, lr_scheduler=None,
                          live_lrs: list | None = None) -> optim.Optimizer:
    """The zfunc optimizer for a script's ``optimizer`` over ``model``'s parameters: its class's
    math, each param group's hyperparameters (the first group's as the optimizer's own, the
    others as ``zf.optim.group`` of their parameters' names) and, given ``lr_scheduler`` (an
    object built on ``optimizer``, or a callable ``optimizer -> scheduler``), each group's lr,
    betas or momentum at every update as the scheduler sets them. ``live_lrs``: instead, each
    group's lr as a ``step -> lr`` read when the update runs (zfunc.engine.handles.LiveLr)."""
    kind, keys = _kind(optimizer)
    if kind != "sgd" and type(optimizer) is torch.optim.Adam:
        modes = {bool(g.get("decoupled_weight_decay", False)) for g in optimizer.param_groups}
        if len(modes) > 1:
            raise ValueError("torch.optim.Adam's param groups differ in decoupled_weight_decay; zfunc's optimizer "
                             "is Adam or AdamW for all its parameters: give every group the same")
    names = _group_names(optimizer, model)
    values = [_group_values(optimizer, k, g, kind, keys) for k, g in enumerate(optimizer.param_groups)]
    if lr_scheduler is not None:
        table = _Table(_scheduler_on_copy(lr_scheduler, optimizer))
        values = [{key: _scheduled(table, k, key, v) if kind != "torch" or key == "lr" else v for key, v in row.items()}
                  for k, row in enumerate(values)]
    elif live_lrs is not None:
        values = [{**row, "lr": live_lrs[k]} for k, row in enumerate(values)]
    own = values[0]
    groups = []
    for k in range(1, len(values)):
        differ = {key: v for key, v in values[k].items() if not _same(v, own[key])}
        if differ and names[k]:
            groups.append(optim.group(names[k], **differ))
    if kind == "sgd":
        return optim.sgd(**own, groups=groups)
    if kind == "torch":  # Muon, Adafactor, RMSprop, ...: whole tensors, each by its owner (docs/optim.md)
        return optim.from_torch(type(optimizer), **own, groups=groups)
    return getattr(optim, kind)(**own, groups=groups)


def schedule_from_client(lr_scheduler, optimizer: torch.optim.Optimizer | float, group: int = 0) -> optim.Schedule:
    """``step -> lr`` of param group ``group`` (DeepSpeed's ``get_lr()[0]`` for the first), as
    ``lr_scheduler`` sets it for each update: an object built on ``optimizer``, or a callable
    ``optimizer -> scheduler``. ``optimizer``: the script's torch optimizer, or, where the config
    builds the optimizer, its lr (the callable is then given a stand-in AdamW with that lr). Where
    the scheduler changes more than the lr (``OneCycleLR``'s momentum), read the optimizer with
    :func:`optimizer_from_client` so the optimizer follows it too."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not callable(lr_scheduler) or hasattr(lr_scheduler, "step"):
            raise TypeError(f"lr_scheduler is a {type(lr_scheduler).__name__} built on an optimizer zfunc was not "
                            "given; pass that optimizer as optimizer=, or pass lr_scheduler as a callable "
                            "optimizer -> scheduler (deepspeed.initialize's form)")
        optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=float(optimizer))
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"schedule_from_client: optimizer must be the torch optimizer lr_scheduler steps, or the "
                        f"config's lr, got {type(optimizer).__name__}")
    if not 0 <= group < len(optimizer.param_groups):
        raise ValueError(f"schedule_from_client: the optimizer has {len(optimizer.param_groups)} param groups, "
                         f"no group {group}")
    table = _Table(_scheduler_on_copy(lr_scheduler, optimizer))
    return lambda step: table.value(step, group, "lr")


# ---------------------------------------------------------------------------- the optimizer


def _kind(optimizer) -> tuple[str, tuple[str, ...]]:
    """``("adamw" | "adam" | "sgd", the hyperparameter keys zfunc's takes)``, or a clear refusal."""
    cls = type(optimizer)
    if cls is torch.optim.AdamW:
        return "adamw", ADAM_KEYS
    if cls is torch.optim.Adam:
        decoupled = optimizer.param_groups[0].get("decoupled_weight_decay", False)
        return ("adamw" if decoupled else "adam"), ADAM_KEYS
    if cls is torch.optim.SGD:
        return "sgd", SGD_KEYS
    if cls.__name__ in DEEPSPEED_ADAMS:
        mode = getattr(optimizer, "adam_w_mode", None)
        if mode is None:
            raise TypeError(f"{cls.__name__} has no adam_w_mode attribute, so whether it is Adam or AdamW is "
                            "unknown; zfunc reads DeepSpeed's FusedAdam and DeepSpeedCPUAdam as DeepSpeed 0.19 builds them")
        if cls.__name__ == "DeepSpeedCPUAdam" and getattr(optimizer, "fp32_optimizer_states", True) is False:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) keeps its moments in the parameters' "
                             "dtype, which a client optimizer cannot tell zfunc: pass fp32_optimizer_states=True, or "
                             "for bf16 moments give zfunc's own optimizer, zf.optim.adamw(lr, "
                             "state_dtype=torch.bfloat16)")
        return ("adamw" if mode else "adam"), ADAM_KEYS
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)):
        raise TypeError(f"optimizer is a {cls.__module__}.{cls.__name__}, a subclass of "
                        f"{cls.__mro__[1].__name__} whose step may differ; zfunc reads torch.optim.AdamW, Adam, SGD and "
                        "DeepSpeed's FusedAdam / DeepSpeedCPUAdam exactly. Build one of those, or pass a zfunc "
                        "optimizer (zf.optim.adamw, ...) through the config")
    if isinstance(optimizer, torch.optim.Optimizer):  # any other class: run as itself (zf.optim.from_torch)
        return "torch", tuple(k for k in optimizer.defaults if k not in TORCH_SWITCHES)
    raise TypeError(f"optimizer is a {cls.__module__}.{cls.__name__}, which zfunc cannot read: it reads "
                    "torch.optim.Optimizer classes (torch.optim.AdamW, Adam, SGD and DeepSpeed's FusedAdam / "
                    "DeepSpeedCPUAdam by zfunc's own fused optimizers, any other through zf.optim.from_torch). Use "
                    "one of those, or name the optimizer in the config's \"optimizer\" block")


def _group_values(optimizer, k: int, g: dict, kind: str, keys) -> dict[str, Any]:
    """Group ``k``'s hyperparameters as zfunc's optimizer takes them; what has no counterpart refused."""
    where = f"{type(optimizer).__name__} param group {k}"
    if kind == "torch":  # the class's own values, as its step reads them
        return {key: g.get(key, optimizer.defaults.get(key)) for key in keys}
    for key in ("amsgrad", "maximize"):
        if g.get(key):
            raise ValueError(f"{where} sets {key}=True, which zfunc's {kind} does not have; set it to False")
    if type(optimizer).__name__ in DEEPSPEED_ADAMS and not g.get("bias_correction", True):
        raise ValueError(f"{where} sets bias_correction=False; zfunc's Adam always corrects the bias "
                         "(as torch.optim.Adam does): set it to True")
    out = {}
    for key in keys:
        v = g.get(key, optimizer.defaults.get(key))
        if key == "nesterov":
            out[key] = bool(v)
        elif key == "betas":
            out[key] = tuple(float(b) for b in v)
        else:
            out[key] = float(v)  # a tensor lr as well
    return out


def _group_names(optimizer, model: nn.Module) -> list[list[str]]:
    """Each param group's trainable parameters by the model's names. A parameter the model lacks, or
    a trainable parameter of the model in no group (torch would not train it), is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimizer_from_client: model must be the nn.Module the optimizer's parameters belong to, "
                        f"got {type(model).__name__}")
    by_id = {id(p): name for name, p in compiled.named_parameters(model)}
    seen: set[int] = set()
    out = []
    for k, g in enumerate(optimizer.param_groups):
        names = []
        for p in g["params"]:
            if id(p) not in by_id:
                raise ValueError(f"{type(optimizer).__name__} param group {k} holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not one of the model's parameters; build the optimizer "
                                 "over model.parameters() (or groups of them)")
            seen.add(id(p))
            if p.requires_grad:
                names.append(by_id[id(p)])
        out.append(names)
    left = [name for name, p in compiled.named_parameters(model) if p.requires_grad and id(p) not in seen]
    if left:
        raise ValueError(f"the model's parameters {left[:3]}{' ...' if len(left) > 3 else ''} ({len(left)} in all) "
                         f"are in no param group of the {type(optimizer).__name__}, so torch would not train them; "
                         "freeze them (p.requires_grad_(False)) before building the state, or add them to a group")
    return out


def _same(a, b) -> bool:
    return not callable(a) and not callable(b) and a == b


# ---------------------------------------------------------------------------- the scheduler


def _scheduler_on_copy(lr_scheduler, optimizer):
    """A private scheduler stepping a private copy of ``optimizer`` (its tensors shared): the copy
    of ``lr_scheduler`` (built on ``optimizer``) or what the callable builds on the copy."""
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("lr_scheduler is a ReduceLROnPlateau: its lr follows the metric the script passes to "
                         "step(metric), not the update count, and zfunc's lr is a function of the update count; "
                         "use a schedule (e.g. CosineAnnealingLR) or set the lr yourself between runs")
    shared = {id(t): t for t in _tensors(optimizer)}
    if hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "optimizer"):
        if lr_scheduler.optimizer is not optimizer:
            raise ValueError(f"lr_scheduler ({type(lr_scheduler).__name__}) is built on another optimizer than the "
                             "one given; build it on the optimizer passed to initialize")
        shared[id(optimizer)] = own = _copy_optimizer(optimizer, shared)
        sched = copy.deepcopy(lr_scheduler, shared)
        if sched.optimizer is not own:
            raise ValueError(f"lr_scheduler ({type(lr_scheduler).__name__}) could not be copied with its optimizer")
        return sched
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        own = _copy_optimizer(optimizer, shared)
        sched = lr_scheduler(own)
        if not (hasattr(sched, "step") and getattr(sched, "optimizer", None) is own):
            raise TypeError(f"lr_scheduler is a callable, which deepspeed.initialize calls with the optimizer; it "
                            f"returned a {type(sched).__name__}, not a scheduler built on that optimizer")
        return _scheduler_on_copy(sched, own)
    raise TypeError(f"lr_scheduler is a {type(lr_scheduler).__module__}.{type(lr_scheduler).__name__}, which zfunc "
                    "cannot follow: give a torch.optim.lr_scheduler object, one of DeepSpeed's (WarmupLR, ...), or a "
                    "callable optimizer -> scheduler")


def _tensors(optimizer) -> list[torch.Tensor]:
    """The parameters and any per-parameter state: shared with the copy, never copied."""
    out = [p for g in optimizer.param_groups for p in g["params"]]
    for s in optimizer.state.values():
        out.extend(v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def _copy_optimizer(optimizer, shared: dict):
    own = copy.deepcopy(optimizer, shared)
    if any(p is not q for g, h in zip(optimizer.param_groups, own.param_groups) for p, q in zip(g["params"], h["params"])):
        raise ValueError(f"the {type(optimizer).__name__} could not be copied with its parameters shared")
    return own


class _Table:
    """The values a scheduler's optimizer holds in each param group after ``k`` steps, row ``k``
    read when first asked for (the updates advance one at a time; rows are kept, so a resumed or
    repeated count reads the same values)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.rows = [self._row()]
        self.lock = threading.Lock()

    def _row(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.scheduler.optimizer.param_groups]

    def value(self, step: int, group: int, key: str, index: int | None = None) -> float:
        with self.lock:
            while len(self.rows) <= step:
                with warnings.catch_warnings():  # torch warns that no optimizer.step() came first
                    warnings.simplefilter("ignore")
                    self.scheduler.step()
                self.rows.append(self._row())
            v = self.rows[step][group][key]
        return float(v if index is None else v[index])


def _scheduled(table: _Table, group: int, key: str, value):
    """``value`` as the scheduler sets it at each update (each of ``betas`` its own schedule)."""
    if key == "nesterov":
        return value
    if key == "betas":
        return tuple(_reader(table, group, key, i) for i in range(len(value)))
    return _reader(table, group, key)


def _reader(table: _Table, group: int, key: str, index: int | None = None) -> Callable[[int], float]:
    return lambda step: table.value(step, group, key, index)
