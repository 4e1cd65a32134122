"""The placement record: where one unit lives and how it moves (docs/architecture.md).

Each transform contributes a pure function ``Placement -> Placement``; a step
folds them in the order written (innermost first) into one record per unit.
The record is the only place that says what materializing a unit and sending
its gradient home mean; the rest of zfunc calls the two stages below, each
split into start and wait (``dist.Pending``) so one coordinator can drive them.

A unit's life::

    home (device / CPU / NVMe; replicated or this rank's shard)
      -- materialize: read in, all-gather if sharded (stored in the compute dtype) -->
    full flat buffer (views handed to the module)  -- released after use
    full flat gradient (one buffer, made by Materialize's backward in the reduce dtype)
      -- send home: all-reduce or reduce-scatter (mean) in the reduce dtype -->
    gradient in the home representation (the param dtype; fp32 accumulators under
    zfunc.transforms.accumulate)  -- the optimizer updates the home copy (or the fp32 master)

| field | today's transforms |
| --- | --- |
| params: replicated or sharded | zero3 shards (units at or over its persistence threshold) |
| grads: all-reduce or reduce-scatter | zero2 and zero3 reduce-scatter |
| opt: replicated or sharded | zero1, zero2, zero3 shard |
| param_dtype, frozen_dtype | mixed_precision stores units (and frozen parameters) in its dtype; they are gathered and run in it |
| reduce_dtype | mixed_precision: the dtype gradients are reduced in (fp32 by default) |
| param_home, grad_home, opt_home | device; offload_cpu: gradients and the optimizer state on the CPU for the update (with ``params=True`` the parameter shards too); offload_nvme: all three in swap files (parameters and optimizer state as asked) |
| acc_home | device; offload_cpu(accumulate_on="host"): the fp32 sums of ``accumulate`` in host memory (units whose gradients are reduce-scattered each micro-batch) |
| replicate | zero1/2/3(mesh=...): the ranks holding the same shard (hybrid sharding); a gradient reduced in the shard group is averaged over them once per step |
| secondary | zero3(reshard_after_forward=k): the k ranks a unit stays sharded over between its forward and its backward (ZeRO++'s hpZ), which backward gathers from |

The homes are read where things move: ``param_home`` by materialization (below) and init,
``grad_home`` by the grad sinks (offload_cpu's ``GradToHost`` copies a gradient to the host
only where it says CPU; a unit whose parameters live on the CPU has its gradient computed
on the device and copied home), ``opt_home`` by the swapped optimizer (a state tensor goes to a swap
file only where it says NVME).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import buffers, dist, layout

REPLICATED, SHARDED = "replicated", "sharded"
ALL_REDUCE, REDUCE_SCATTER = "all_reduce", "reduce_scatter"
DEVICE, CPU, NVME = "device", "cpu", "nvme"


@dataclass(frozen=True)
class Placement:
    """One unit's placement. ``None`` dtypes mean the model's own dtype."""

    params: str = REPLICATED
    param_home: str = DEVICE
    param_dtype: torch.dtype | None = None  # storage = gather = compute dtype
    frozen_dtype: torch.dtype | None = None
    grads: str = ALL_REDUCE
    reduce_dtype: torch.dtype | None = None
    grad_home: str = DEVICE  # where a unit's gradient goes once reduced
    opt: str = REPLICATED
    opt_home: str = DEVICE
    acc_home: str = DEVICE  # where an accumulating step keeps the unit's fp32 sum between micro-batches
    # hybrid sharding: ``dist.group_key`` of the ranks that hold the same shard as this one (the mesh's
    # replicate dim; None: no replicas), over which the shard group's reduced gradient is averaged
    replicate: tuple[int, ...] | None = None
    # hpZ: ``dist.group_key`` of the k ranks (a part of the shard group) over which a unit stays sharded
    # from its forward to its backward, so backward's all-gather stays among them (None: gathered anew)
    secondary: tuple[int, ...] | None = None

    def __post_init__(self):
        for field, value, allowed in (("params", self.params, (REPLICATED, SHARDED)),
                                      ("opt", self.opt, (REPLICATED, SHARDED)),
                                      ("grads", self.grads, (ALL_REDUCE, REDUCE_SCATTER)),
                                      ("param_home", self.param_home, (DEVICE, CPU, NVME)),
                                      ("grad_home", self.grad_home, (DEVICE, CPU, NVME)),
                                      ("opt_home", self.opt_home, (DEVICE, CPU, NVME)),
                                      ("acc_home", self.acc_home, (DEVICE, CPU))):
            if value not in allowed:
                raise ValueError(f"Placement.{field} must be one of {allowed}, got {value!r}")

    @property
    def params_sharded(self) -> bool:
        return self.params == SHARDED

    @property
    def grads_sharded(self) -> bool:
        return self.grads == REDUCE_SCATTER

    @property
    def opt_sharded(self) -> bool:
        return self.opt == SHARDED


def gathers(place: Placement, group) -> bool:
    """Whether materializing all-gathers (a sharded leaf with W > 1)."""
    return place.params_sharded and dist.world_size(group) > 1


def copies_in(place: Placement) -> bool:
    """Whether materializing first copies a host shard to the compute device (``param_home``
    CPU), making a new buffer even where nothing is gathered; on a CPU group the copy is a
    plain one, so the tier's life is the same there."""
    return place.param_home == CPU


def compute_device(place: Placement, leaf: torch.Tensor, group) -> torch.device:
    """Where the unit's full buffer and gradient live: the group's device for a unit copied in
    from host memory or read from disk (a meta placeholder), else the leaf's own."""
    if copies_in(place) or leaf.is_meta:
        return dist.compute_device(group)
    return leaf.device


def materialize_start(place: Placement, leaf: torch.Tensor, group, ready: Callable[[], None], store=None
                      ) -> dist.Pending:
    """Start turning the stored ``leaf`` into the full flat buffer.

    ``ready`` returns once the leaf's own values are complete (an update's
    all-gather may still be filling a replicated leaf). A leaf on NVMe is
    first read from ``store`` (its ``zfunc.swap.SwapStore``; ``leaf`` is then
    the placeholder) into a pool buffer, which the all-gather, if any, gives
    back as soon as it is done. A leaf in host memory (``param_home`` CPU) is first copied
    to the group's device (``_copy_in``).
    """
    if place.param_home == NVME:
        read = store.read_start(leaf)
        if not gathers(place, group):
            return read
        w = dist.world_size(group)
        full = buffers.take(leaf.numel() * w, leaf.dtype, read.out.device)

        def gather(shard):
            dist.all_gather_start(shard, group, out=full).wait()
            store.give(shard)

        return read.then(gather, full)
    if copies_in(place):
        return _copy_in(place, leaf, group, ready)
    ready()
    if gathers(place, group):
        return dist.all_gather_start(leaf.detach(), group)
    return dist.Pending(leaf.detach())


def _copy_in(place: Placement, leaf: torch.Tensor, group, ready) -> dist.Pending:
    """The host shard copied into its slot of a new full buffer on the compute device
    (asynchronously from pinned memory), then gathered in place: no staging buffer."""
    ready()
    w = dist.world_size(group) if place.params_sharded else 1
    full = buffers.take(leaf.numel() * w, leaf.dtype, dist.compute_device(group))
    mine = layout.shard(full, dist.rank(group), w) if w > 1 else full
    mine.copy_(leaf.detach(), non_blocking=leaf.is_pinned())
    return dist.all_gather_inplace_start(full, group) if w > 1 else dist.Pending(full)


def send_home_start(place: Placement, grad_full: torch.Tensor, group, out_dtype: torch.dtype | None = None,
                    *, final: bool = True) -> dist.Pending:
    """Start reducing a unit's full gradient (which the caller gives up) to its home form.

    The reduction runs in ``place.reduce_dtype`` (default: the gradient's own);
    the result comes in ``out_dtype`` (default: the reduce dtype), in a tensor
    that exists from the start and is filled by ``wait()``, on the gradient's
    device; a grad sink of offload (``GradToHost``, ``GradToDisk``) takes it
    to ``place.grad_home`` from there.

    Under hybrid sharding (``place.replicate``) a ``final`` reduction, the step's last of this
    gradient, is then averaged over the replicas in the reduce dtype (``replicate_mean``); an
    accumulating step reduces each micro-batch's shard with ``final=False`` and averages the sum
    once, after the last micro-batch's shard is in it.
    """
    reduce_dtype = place.reduce_dtype or grad_full.dtype
    out_dtype = out_dtype or reduce_dtype
    if final and place.replicate is not None:
        pending = send_home_start(place, grad_full, group, reduce_dtype, final=False)
        return pending.then(lambda g: replicate_mean(place, g)).cast(out_dtype)
    if dist.world_size(group) == 1:
        return dist.Pending(grad_full if grad_full.dtype == out_dtype else grad_full.to(out_dtype))
    if grad_full.dtype != reduce_dtype:
        wide = buffers.take(grad_full.numel(), reduce_dtype, grad_full.device)
        wide.copy_(grad_full)
        buffers.give(grad_full)
        grad_full = wide
    if place.grads_sharded:
        return dist.reduce_scatter_mean_start(grad_full, group, scratch=True, out_dtype=out_dtype)
    return dist.all_reduce_mean_start(grad_full, group).cast(out_dtype)


def replicate_mean(place: Placement, g: torch.Tensor) -> torch.Tensor:
    """``g`` (a gradient in its home form, reduced in the shard group) averaged in place over the
    ranks that hold the same shard (``place.replicate``; none: ``g`` as it is)."""
    if place.replicate is not None:
        dist.all_reduce_mean(g, dist.group_of(place.replicate))
    return g


def grad_is_shard(place: Placement, leaf_is_shard: bool) -> bool:
    """Whether a unit's gradient, once home, is this rank's shard (else the full buffer)."""
    return leaf_is_shard or place.grads_sharded


def optimizer_slices(place: Placement, leaf_is_shard: bool) -> bool:
    """Whether the optimizer updates only this rank's slice of a leaf that holds the full buffer."""
    return place.opt_sharded and not leaf_is_shard
