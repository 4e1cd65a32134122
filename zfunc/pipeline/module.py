"""Pipeline parallelism: a model as a list of layers, cut into stages built lazily.

``PipelineModule(layers, num_stages, loss_fn)`` takes a list whose items are
modules, plain callables, ``LayerSpec(cls, *args, **kw)`` (built only by the stage
that owns it) or ``TiedLayerSpec(key, cls, ...)`` (one module shared by every stage
that lists its key: an embedding and the LM head reading its weight). It decides
which layers go to which stage (``partition_method``) and builds one stage's
``StageModule`` on request; nothing of the other stages is constructed, except
that ``partition_method="parameters"`` counts each ``LayerSpec``'s parameters by
building it on the meta device (no memory; "uniform" and "type:REGEX" build
nothing).

Ranks form a grid of ``P`` pipeline stages x ``D`` data-parallel replicas in
DeepSpeed's topology order (``PipeDataParallelTopology``: axes pipe, then data):
rank ``r`` is stage ``r // D``, replica ``r % D``. Each stage's replicas form its
data-parallel group (zero1/zero2 and gradient averaging happen there); stage
``s``'s replica ``d`` sends activations to rank ``(s + 1) * D + d``; the ranks of
replica ``d`` on the stages that own a tied key sum that module's gradients.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .. import dist
from .schedules import SCHEDULES


@dataclass(frozen=True)
class LayerSpec:
    """A layer to build later: ``cls(*args, **kwargs)``, on the stage that owns it only."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __init__(self, cls, *args, **kwargs):
        if not callable(cls):
            raise TypeError(f"LayerSpec takes a class (or factory) and its arguments, got {cls!r}")
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)

    def build(self) -> nn.Module:
        return self.cls(*self.args, **self.kwargs)

    @property
    def name(self) -> str:
        return getattr(self.cls, "__name__", type(self.cls).__name__)


@dataclass(frozen=True)
class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every stage listing ``key`` (built once per stage;
    the copies start equal and their gradients are summed across those stages, so they stay
    equal). ``forward_fn(module, x)`` replaces ``module(x)`` where given (the LM head as
    ``lambda emb, h: h @ emb.weight.t()``); ``tied_weight_attr`` names the shared weight."""

    key: str = ""
    forward_fn: Callable | None = None
    tied_weight_attr: str = "weight"

    def __init__(self, key, cls, *args, forward_fn=None, tied_weight_attr="weight", **kwargs):
        super().__init__(cls, *args, **kwargs)
        object.__setattr__(self, "key", str(key))
        object.__setattr__(self, "forward_fn", forward_fn)
        object.__setattr__(self, "tied_weight_attr", tied_weight_attr)


def _layer_name(item) -> str:
    if isinstance(item, LayerSpec):
        return item.name
    if isinstance(item, nn.Module):
        return type(item).__name__
    return getattr(item, "__name__", type(item).__name__)


def _count_params(item) -> int:
    if isinstance(item, LayerSpec):
        with torch.device("meta"):
            return sum(p.numel() for p in item.build().parameters())
    if isinstance(item, nn.Module):
        return sum(p.numel() for p in item.parameters())
    return 0


def balance(weights: list[float], parts: int) -> list[int]:
    """Boundaries ``b`` (``parts + 1`` of them) cutting ``weights`` into ``parts`` contiguous,
    non-empty runs whose largest sum is as small as it can be; ties go to earlier cuts."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cuts(limit):  # greedy: as many layers per part as fit under ``limit``, keeping one per later part
        bounds, start = [0], 0
        for k in range(parts - 1):
            end = start + 1
            while end < n - (parts - 2 - k) and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            bounds.append(end)
            start = end
        bounds.append(n)
        ok = all(prefix[b] - prefix[a] <= limit for a, b in zip(bounds, bounds[1:]))
        return bounds if ok else None

    candidates = sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # the smallest achievable largest part
        mid = (lo + hi) // 2
        if cuts(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return cuts(candidates[lo])


class PipelineModule:
    """The whole model as layers and how they split into stages; ``build(stage)`` makes one stage."""

    def __init__(self, layers: list, num_stages: int, loss_fn: Callable, partition_method: str = "parameters",
                 schedule: str = "1f1b"):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: choose from {', '.join(SCHEDULES)}")
        self.schedule = schedule
        layers = list(layers)
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
        if len(layers) < num_stages:
            raise ValueError(f"{num_stages} stages need at least {num_stages} layers; this model has {len(layers)}: "
                             "use fewer stages")
        for i, item in enumerate(layers):
            if not (isinstance(item, (LayerSpec, nn.Module)) or callable(item)):
                raise TypeError(f"layer {i} is a {type(item).__name__}: a pipeline layer is an nn.Module, a "
                                "callable, a LayerSpec or a TiedLayerSpec")
        self.layers = layers
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.parts = self._partition(partition_method)

    def _partition(self, method: str) -> list[int]:
        n, p = len(self.layers), self.num_stages
        if method == "uniform":
            weights = [1.0] * n
        elif method == "parameters":
            weights = [float(_count_params(item)) for item in self.layers]
            if not any(weights):
                weights = [1.0] * n
        elif method.startswith("type:"):
            pattern = re.compile(method[len("type:"):], re.IGNORECASE)
            weights = [1.0 if pattern.search(_layer_name(item)) else 0.0 for item in self.layers]
            if sum(weights) < p:
                raise ValueError(f"partition_method {method!r} matches {int(sum(weights))} layers, fewer than the "
                                 f"{p} stages")
        else:
            raise ValueError(f"partition_method must be 'parameters', 'uniform' or 'type:REGEX', got {method!r}")
        # a stage must hold at least one layer: give every layer a small weight
        return balance([w + 1e-9 for w in weights], p)

    def stage_layers(self, stage: int) -> range:
        return range(self.parts[stage], self.parts[stage + 1])

    def tied_stages(self) -> dict[str, list[int]]:
        """Each tied key and the stages that hold it."""
        out: dict[str, list[int]] = {}
        for s in range(self.num_stages):
            for i in self.stage_layers(s):
                item = self.layers[i]
                if isinstance(item, TiedLayerSpec) and s not in out.setdefault(item.key, []):
                    out[item.key].append(s)
        return out

    def unit_names(self, stage: int, parts: list[int] | None = None) -> dict:
        """What each parameter-holding unit of stage ``stage`` (under cuts ``parts``, default these)
        is, by its name in the StageModule: ``("layer", i)`` for global layer ``i``, ``("tied", key)``."""
        parts = self.parts if parts is None else parts
        out, modules, tied = {}, 0, []
        for i in range(parts[stage], parts[stage + 1]):
            item = self.layers[i]
            if isinstance(item, TiedLayerSpec):
                if item.key not in tied:
                    out[f"tied.{len(tied)}"] = ("tied", item.key)
                    tied.append(item.key)
            elif isinstance(item, (LayerSpec, nn.Module)):
                out[f"layers.{modules}"] = ("layer", i)
                modules += 1
        return out

    def build(self, stage: int) -> "StageModule":
        """Stage ``stage``'s layers, constructed now (and only them)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        return StageModule(self, stage)

    def build_all(self) -> nn.Module:
        """The whole model in one module (the reference the tests compare with)."""
        return StageModule(self, None)


class StageModule(nn.Module):
    """One stage's layers, in order; a tied module is built once per stage and reused."""

    def __init__(self, pipe: PipelineModule, stage: int | None):
        super().__init__()
        indices = range(len(pipe.layers)) if stage is None else pipe.stage_layers(stage)
        self.stage = stage
        self.first = stage in (None, 0)
        self.last = stage is None or stage == pipe.num_stages - 1
        self.layers = nn.ModuleList()
        self.tied = nn.ModuleList()  # one unit each, laid out the same on every stage that has it
        self.tied_keys: list[str] = []
        self._calls: list[tuple[int, str, Any]] = []  # (layer index, kind, what)
        for i in indices:
            item = pipe.layers[i]
            if isinstance(item, TiedLayerSpec):
                if item.key not in self.tied_keys:
                    self.tied_keys.append(item.key)
                    self.tied.append(item.build())
                self._calls.append((i, "tied", item))
            elif isinstance(item, LayerSpec):
                self.layers.append(item.build())
                self._calls.append((i, "module", len(self.layers) - 1))
            elif isinstance(item, nn.Module):
                self.layers.append(item)
                self._calls.append((i, "module", len(self.layers) - 1))
            else:
                self._calls.append((i, "callable", item))

    def forward(self, *x):
        for i, kind, what in self._calls:
            if kind == "module":
                layer = self.layers[what]
                out = layer(*x)
            elif kind == "tied":
                layer = what
                module = self.tied[self.tied_keys.index(what.key)]
                out = what.forward_fn(module, *x) if what.forward_fn is not None else module(*x)
            else:
                layer = what
                out = what(*x)
            x = _as_activation(out, i, _layer_name(layer))
        return x[0] if len(x) == 1 else x


def _as_activation(out, index: int, name: str) -> tuple:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return out
    raise TypeError(f"pipeline layer {index} ({name}) returned a {type(out).__name__}: activations passed "
                    "between layers must be a tensor or a tuple of tensors")


# --------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Grid:
    """This rank's place in the pipe x data grid, and the process groups it needs."""

    stages: int
    replicas: int
    stage: int
    replica: int
    data_group: Any  # this stage's replicas (None when D = 1 and W = 1)
    tied_groups: dict  # key -> the group of this replica's ranks on the stages holding key (None: one stage)

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        return stage * self.replicas + (self.replica if replica is None else replica)

    @property
    def prev(self) -> int:
        return self.rank_of(self.stage - 1)

    @property
    def next(self) -> int:
        return self.rank_of(self.stage + 1)


def make_grid(pipe: PipelineModule) -> Grid:
    """Every rank calls it (process groups are made collectively, in one order on all ranks)."""
    world, rank, p = dist.world_size(), dist.rank(), pipe.num_stages
    if world % p:
        raise ValueError(f"world size {world} does not split into {p} pipeline stages: it must be a multiple "
                         f"of num_stages (stages x data-parallel replicas)")
    d = world // p
    stage, replica = rank // d, rank % d
    data_group = None
    if world > 1:
        for s in range(p):
            g = dist.new_group([s * d + k for k in range(d)])
            if s == stage:
                data_group = g
    tied_groups = {}
    for key, owners in sorted(pipe.tied_stages().items()):
        for k in range(d):
            ranks = [s * d + k for s in owners]
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if stage in owners and k == replica:
                tied_groups[key] = g
    return Grid(p, d, stage, replica, data_group, tied_groups)
