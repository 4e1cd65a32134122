"""ZeRO stages 1, 2 and 3 as step transforms.

Each stage contributes a placement function (what is sharded) and, for every
stage, the same wrapper of the update part: the optimizer sees only this
rank's slice of each unit (``Params.local``) and the updated slices are
all-gathered back into the full buffers (``Params.from_local``) where
parameters are replicated. Materialization and gradient reduction follow
from the placement record (zfunc.placement).

| stage | parameters | gradients | optimizer state |
| --- | --- | --- | --- |
| 0 (``train_step``) | replicated | all-reduced | replicated |
| 1 | replicated | all-reduced | sharded |
| 2 | replicated | reduce-scattered | sharded |
| 3 | sharded, gathered per unit | reduce-scattered | sharded |

Hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS): given ``mesh=`` (a 2-D DeviceMesh, dims
replicate and shard: zfunc.transforms.hybrid) each stage shards over the shard group, the
step's group, and every shard group holds the same state; a gradient reduced in the shard
group is averaged over the replicate group once a step (``Placement.replicate``), and the
step's agreement spans every rank.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import dist
from ..coordinator import Prefetch, prefetch_settings
from ..optim.base import Optimizer, apply_update
from ..placement import CPU, DEVICE, NVME, REDUCE_SCATTER, SHARDED, Placement, optimizer_slices
from ..step import Step, expect_step, set_units
from ..transform import Transform
from ..tree import UpdateFailed
from .hybrid import read_mesh, secondary_group


class Zero(Transform):
    family = "zero"

    def __init__(self, stage: int, group=None, persistence_threshold: int = 0, prefetch: Prefetch | None = None,
                 replicate=None, secondary=None):
        self.stage = stage
        self.group = group  # the shard group
        self.replicate = replicate  # hybrid sharding: the ranks holding the same shards (None: none)
        self.secondary = secondary  # hpZ: this rank's group of k within the shard group (None: none)
        self.persistence_threshold = persistence_threshold
        self.prefetch = prefetch  # the coordinator's settings, if given here

    @property
    def name(self) -> str:
        return f"zero{self.stage}"

    def describe(self, inner: str) -> str:
        extra = f", persistence_threshold={self.persistence_threshold}" if self.persistence_threshold else ""
        if self.replicate is not None:
            extra += f", mesh={dist.world_size(self.replicate)}x{dist.world_size(self.group)}"
        if self.secondary is not None:
            extra += f", reshard_after_forward={dist.world_size(self.secondary)}"
        return f"zero{self.stage}({inner}{extra})"

    def check(self, inner) -> None:
        for t in inner:
            if t.family == "zero":
                raise ValueError(f"this step is already ZeRO stage {t.stage}; apply one of zero1/zero2/zero3, once")
            why = t.params_off_device_error(self.stage) if self.stage in (1, 2) else None
            if why is not None:
                raise ValueError(why)
            if self.replicate is not None and getattr(t, "accumulate_on", None) == "host" and torch.cuda.is_available():
                raise ValueError("offload_cpu(accumulate_on='host') under hybrid sharding (mesh=) is not supported yet "
                                 "where there is a GPU: the host sums are added by a worker thread the replicas' "
                                 "average does not wait for; use accumulate_on='device'")

    def place(self, p: Placement, unit) -> Placement:
        p = replace(p, opt=SHARDED, replicate=dist.group_key(self.replicate))
        if self.stage >= 2:
            p = replace(p, grads=REDUCE_SCATTER)
        if self.stage == 3 and unit.trainable.numel + unit.frozen.numel >= self.persistence_threshold:
            p = replace(p, params=SHARDED, secondary=dist.group_key(self.secondary))
        elif self.stage == 3 and p.param_home in (CPU, NVME):
            p = replace(p, param_home=DEVICE)  # a persistent unit stays on the device, whole, on every rank
        return p

    def wrap_optimizer(self, optimizer):
        return sharded_optimizer(optimizer, agree_over=None if self.replicate is not None else self.group)


def sharded_optimizer(optimizer, agree_over=None) -> Optimizer:
    """``optimizer`` over this rank's slice of each unit; updated slices gathered back. Whether an
    update failed is agreed over ``agree_over`` (the step's agreement group: every rank of a mesh)."""

    def init(params):
        return optimizer.init(params.local())

    def update(grads, opt_state, params, **kw):
        agree = _gathers(params)
        try:
            local, opt_state = apply_update(optimizer, grads.local(), opt_state, params.local(), **kw)
        except BaseException:
            if agree:
                _agree_on_update(agree_over, failed=True)
            raise
        if agree:
            _agree_on_update(agree_over, failed=False)
        return params.from_local(local), opt_state

    return Optimizer(init, update, fuses=True)


def _gathers(params) -> bool:
    """Whether the update ends in all-gathers (``from_local``: zero1/2's full parameters, W > 1) of
    slices some of which the host writes (offload_cpu, offload_nvme, or any update on a CPU device):
    an update that can fail partway on one rank, where agreeing costs no extra wait. An update on a
    GPU alone is not agreed on, so its gathers keep free of a host sync; a rank whose GPU update
    raises is named by the collective timeout."""
    group, places = params.spec.process_group, params.spec.placements
    on_host = dist.compute_device(group).type == "cpu" or any(p.opt_home != DEVICE for p in places)
    return (dist.world_size(group) > 1 and on_host
            and any(optimizer_slices(place, held) and not held for held, place in zip(params.spec.sharded, places)))


def _agree_on_update(group, *, failed: bool) -> None:
    """Before the all-gathers of the updated slices: one all-reduce of whether this rank's update
    failed. If any rank's did, no rank gathers (a rank whose update went through would otherwise
    gather a failed rank's half-updated slice into its parameters, and wait on gathers that rank
    never starts): each raises here, its own error on the failed rank, ``UpdateFailed`` on the
    others, and the step refuses the state on every rank from then on (``Step._finish``)."""
    flag = torch.tensor([float(failed)], dtype=torch.float64, device=dist.device_of(group))
    dist.all_reduce_sum(flag, group)
    if flag.item() and not failed:
        raise UpdateFailed(
            f"another rank's optimizer update failed ({int(flag.item())} of {dist.world_size(group)} ranks), so no "
            "rank gathered the updated slices; that rank's error names the cause")


def _zero(step: Step, stage: int, group, mesh=None, reshard_after_forward=True, **kw) -> Step:
    expect_step(step, f"zero{stage}")
    replicate, rows = None, None
    if mesh is not None:
        if group is not None:
            raise ValueError(f"zero{stage}: give group= (flat sharding over one group) or mesh= (hybrid sharding), "
                             "not both")
        group, replicate, rows = read_mesh(mesh, f"zero{stage}")
    secondary = secondary_group(reshard_after_forward, group, rows)
    dist.group_key(group)  # remember the groups under their keys, for specs that name them
    dist.group_key(replicate)
    dist.group_key(secondary)
    return step.then(Zero(stage, group, replicate=replicate, secondary=secondary, **kw))


def zero1(step: Step, *, group=None, mesh=None) -> Step:
    """Shard optimizer state across ``group`` (default: the whole world).

    ``mesh``: hybrid sharding instead (module docstring): a 2-D ``DeviceMesh`` with dims
    (replicate, shard), e.g. ``zf.dist.mesh()``; the same for zero2 and zero3."""
    return _zero(step, 1, group, mesh)


def zero2(step: Step, *, group=None, mesh=None) -> Step:
    """Shard optimizer state and reduce-scatter gradients."""
    return _zero(step, 2, group, mesh)


def zero3(step: Step, units=None, *, group=None, mesh=None, persistence_threshold: int = 0,
          prefetch_bucket_size: int | None = None, max_live_parameters: int | None = None,
          max_reuse_distance: int | None = None, collective_timeout: float | None = None,
          reshard_after_forward: bool | int = True) -> Step:
    """Shard parameters too: each unit is gathered just before its module runs.

    ``units``: ``None`` (each child of every ``nn.ModuleList`` plus a root
    unit), a list of module names, or a predicate ``(name, module) -> bool``;
    the same as ``zf.units(step, units)``. Units with fewer than
    ``persistence_threshold`` elements stay replicated (and on the device under
    ``offload_nvme`` or ``offload_cpu(params=True)``).

    The coordinator's settings (zfunc.coordinator), in elements:
    ``prefetch_bucket_size``: how far ahead of use units are gathered, along
    the order recorded in the first step (0: on demand only; default twice
    the largest unit; DeepSpeed's default, 5e7, holds most of a small model);
    ``max_live_parameters``: the most gathered or in flight at once (default
    DeepSpeed's 1e9); ``max_reuse_distance``: a unit used
    again within this many elements of other materializations stays gathered
    (default 0: released after each use, so memory stays at ZeRO-3's
    formula). ``collective_timeout``: seconds a step's collective may take
    before every rank raises, naming where the ranks' orders differ (default
    300; None waits forever).

    ``reshard_after_forward`` (FSDP2's name): True (the default) gathers a unit anew over the shard
    group for backward; an int k (ZeRO++'s hpZ, ``zero_hpz_partition_size``) keeps each unit sharded
    over k consecutive ranks of the shard group (a node's) from its forward to its backward, so
    backward's all-gathers stay among them, at 1/k of each unit a rank held between them.
    """
    if units is not None:
        step = set_units(step, units)
    prefetch = prefetch_settings(prefetch_bucket_size=prefetch_bucket_size, max_live_parameters=max_live_parameters,
                                 max_reuse_distance=max_reuse_distance, collective_timeout=collective_timeout)
    return _zero(step, 3, group, mesh, reshard_after_forward, persistence_threshold=persistence_threshold,
                 prefetch=prefetch)
