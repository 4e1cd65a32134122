"""The bytes a rank holds for the model state, part by part and home by home, as ``zf.memory_report``
reports them for a state the composition builds; and the gradients a step holds besides."""
from __future__ import annotations

import torch

from .composition import Composition, place

COUNT_BYTES = 8  # an int64 update count: the optimizer's (one, and one per parameter) and the state's


def size_of(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def shard_size(comp: Composition, nodes: int, per_node: int) -> int:
    """The ranks a unit is split over: a node's under hybrid sharding, else every rank."""
    return per_node if comp.hybrid else nodes * per_node


def moment_dtype(comp: Composition, param_dtype: torch.dtype) -> torch.dtype:
    """Adam's moments' dtype: bf16 if asked, else fp32 (fp64 for fp64 weights): zf.optim.adamw's rule,
    over the fp32 master weights under mixed precision."""
    if comp.state_dtype == torch.bfloat16:
        return torch.bfloat16
    return torch.float64 if comp.dtype is None and param_dtype == torch.float64 else torch.float32


def memory(shape, comp: Composition, shard: int, accelerator: bool = True) -> dict:
    """``shape`` (zfunc.estimator.model) under ``comp`` over ``shard`` ranks, per rank: ``param_bytes``,
    ``optimizer_bytes``, ``frozen_bytes``, ``buffer_bytes`` (as ``memory_report``), and ``by_home``
    (``device``, ``host``: pinned or not, ``disk``); ``grad_bytes``: the gradients held when the
    update runs (not part of the state: the reduced gradients of every unit, this rank's shards
    where they are reduce-scattered, fp32 sums under accumulation), with their home."""
    params = frozen = counts = grads = master = moments = 0
    for unit in shape.units:
        p = place(unit, comp, shard)
        param_dtype = comp.dtype or unit.dtype
        params += p.held(p.padded, p.params_sharded) * size_of(param_dtype)
        frozen += p.held(p.frozen_padded, p.params_sharded) * size_of(comp.dtype or unit.frozen_dtype)
        moments += 2 * p.local * size_of(moment_dtype(comp, unit.dtype))  # Adam's two moments
        master += p.local * 4 if comp.dtype is not None else 0  # mixed precision's fp32 master weights
        counts += COUNT_BYTES * unit.trainable_entries  # an update count per parameter
        grad_dtype = torch.float32 if comp.accumulate > 1 or comp.dtype is not None else unit.dtype
        grads += p.held(p.padded, p.grads_sharded) * size_of(grad_dtype)
    counts += COUNT_BYTES  # the optimizer's count
    opt = moments + master + counts
    buffers = sum(shape.buffer_bytes)
    homes = {"device": 0, "host": 0, "disk": 0}
    param_home = {"cpu": "host", "nvme": "disk"}[comp.offload] if comp.params_offloaded else "device"
    opt_home = {None: "device", "cpu": "host", "nvme": "disk"}[comp.offload]
    homes[param_home] += params + frozen
    homes[opt_home] += moments + master
    homes["host"] += counts + COUNT_BYTES  # update counts stay in RAM wherever the rest goes; the state's count
    homes["device"] += buffers
    grad_home = "host" if comp.offload is not None else "device"
    if not accelerator:  # a CPU-only machine: its RAM is the device's memory
        homes = {"device": homes["device"] + homes["host"], "host": 0, "disk": homes["disk"]}
        grad_home = "device"
    return {"param_bytes": params, "optimizer_bytes": opt, "frozen_bytes": frozen, "buffer_bytes": buffers,
            "by_home": homes, "grad_bytes": grads, "grad_home": grad_home}
