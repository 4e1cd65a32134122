"""A step's time: compute from the model's operations and a device's rate, each collective from an
alpha-beta model of a ring, and the overlap zfunc's coordinator achieves.

A ring collective over p ranks moving a buffer of B bytes on a link of bandwidth bw (bytes/s a rank
moves) and per-hop latency alpha: all-gather and reduce-scatter take (p-1)/p * B / bw + (p-1) * alpha;
an all-reduce (a reduce-scatter, then an all-gather) twice that; a broadcast B / bw + (p-1) * alpha.

The overlap assumed: the coordinator prefetches zero3's gathers along the recorded trace and
reduces each unit's gradient as its backward ends, and stages 1 and 2 leave their gathers to run
under the next forward, so every collective but the first gather and the last reduction of each
micro-batch (and the buffers' broadcast) runs while the device computes: the step takes the
waited-for collectives, plus the longer of the compute and the rest of the communication, plus the
optimizer's update (its state streamed once through memory).
"""
from __future__ import annotations

from .cluster import Cluster
from .composition import Composition, place
from .memory import moment_dtype
from .traffic import Collective

_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}


def wire_bytes(kind: str, nbytes: int, ranks: int) -> float:
    """Bytes each rank sends for one ring collective of ``nbytes`` over ``ranks``."""
    if ranks <= 1:
        return 0.0
    if kind == "broadcast":
        return float(nbytes)
    return _FACTOR[kind] * (ranks - 1) / ranks * nbytes


def seconds(kind: str, nbytes: int, ranks: int, link) -> float:
    """One collective's time under the alpha-beta model (module docstring)."""
    if ranks <= 1:
        return 0.0
    hops = (ranks - 1) * (2 if kind == "all_reduce" else 1)
    return wire_bytes(kind, nbytes, ranks) / link.bandwidth + hops * link.latency


def update_bytes(shape, comp: Composition, shard: int) -> int:
    """Bytes the optimizer's update reads and writes on a rank: per element it updates, the parameter
    (and the fp32 master), Adam's two moments read and written, the gradient read."""
    total = 0
    for unit in shape.units:
        p = place(unit, comp, shard)
        param = 2 if comp.dtype is not None and comp.dtype.itemsize == 2 else unit.dtype.itemsize
        state = moment_dtype(comp, unit.dtype).itemsize
        master = 8 if comp.dtype is not None else 0
        grad = 4 if comp.dtype is not None or comp.accumulate > 1 else unit.dtype.itemsize
        total += p.local * (param + master + 4 * state + grad)
    return total


def step_time(shape, comp: Composition, cluster: Cluster, events: list[Collective], overlap: bool = True) -> dict:
    """Seconds for one step: ``compute``, ``comm`` (every collective, back to back), ``exposed`` (the
    collectives the step waits for), ``update``, and ``step``; with ``overlap=False`` nothing hides."""
    shard = cluster.per_node if comp.hybrid else cluster.world
    compute = shape.flops_per_token * comp.micro_batch_tokens * comp.accumulate / cluster.flops
    waited = hidden = 0.0
    for e in events:
        t = e.calls * seconds(e.kind, e.nbytes, cluster.group_size(e.label, comp), cluster.link(e.label))
        if e.overlapped and overlap:
            hidden += t
        else:
            waited += t
    update = update_bytes(shape, comp, shard) / cluster.memory_rate
    step = waited + max(compute, hidden) + update if overlap else compute + waited + update
    return {"compute": compute, "comm": waited + hidden, "exposed": waited + max(0.0, hidden - compute),
            "update": update, "step": step}
