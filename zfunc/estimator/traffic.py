"""The collectives one step issues, unit by unit, as ``metrics["comm"]`` counts them: per group
label (``"world"`` flat; ``"shard"`` and ``"replicate"`` under a mesh), per kind, calls and bytes of
the collective's whole buffer (an all-gather's output, a reduce-scatter's input, an all-reduce's
tensor). zfunc's own schedule (docs/architecture.md, "A unit's life"):

* zero3 gathers each sharded unit in every micro-batch's forward and again in its backward, except
  the root unit and the unit forward used last, which are kept for backward, and the first block
  where no trainable root (embeddings) runs before it: its backward needs no weight (forward is
  taken to run the units in module order);
* a gradient that goes home as a shard (zero2, zero3) is reduce-scattered every micro-batch (on
  gloo: all-reduced whole and sliced, which is faster there, and counted as an all-reduce); one
  that goes home whole (stage 0, zero1) is summed locally and all-reduced once, in the last;
* zero3(reshard_after_forward=k) (hpZ) gathers a block for backward among its ``"secondary"`` group
  of k ranks instead of the shard group;
* under a mesh the reduced gradient is averaged over the replicate group once a step;
* units whose parameters stay whole but whose optimizer state is sharded (zero1, zero2, zero3's
  persistent units) all-gather the updated slices once a step, after the ranks agree in one 8-byte
  all-reduce that every update went through;
* the buffers are broadcast from rank 0 once a step.

The step's agreement vectors (kind ``"agreement"``) and barriers are left out: a few bytes a step.
"""
from __future__ import annotations

from dataclasses import dataclass

from .composition import Composition, place
from .memory import size_of


@dataclass(frozen=True)
class Collective:
    """One collective a step issues ``calls`` times: its group, kind and buffer bytes, and whether the
    coordinator can hide it behind compute (``overlapped``; else the step waits for it)."""

    label: str
    kind: str
    nbytes: int
    calls: int
    overlapped: bool


def collectives(shape, comp: Composition, nodes: int, per_node: int, backend: str = "nccl") -> list[Collective]:
    """Every collective of one step of ``comp`` on ``shape`` (zfunc.estimator.model) over ``nodes`` x
    ``per_node`` ranks, in the order the step issues them per unit. Under ``backend`` gloo a gradient
    that goes home as a shard is all-reduced whole and sliced (counted, and timed, as an all-reduce)."""
    world = nodes * per_node
    if world == 1:
        return []
    shard_label = "shard" if comp.hybrid else "world"
    shard = per_node if comp.hybrid else world
    replicas = nodes if comp.hybrid else 1
    n = comp.accumulate
    out: list[Collective] = []
    sharded = [i for i, u in enumerate(shape.units) if place(u, comp, shard).params_sharded]
    blocks = [i for i in sharded if shape.units[i].name != ""]
    roots = [i for i, u in enumerate(shape.units) if u.name == ""]
    # the root unit and the last block forward used stay gathered for backward; with no trainable
    # root (embeddings) running first, the first block's input needs no gradient, so its backward
    # reads no weight of it and never gathers it again
    kept = set(roots) & set(sharded) | set(blocks[-1:])
    if not any(shape.units[i].trainable for i in roots):
        kept |= set(blocks[:1])
    for i, unit in enumerate(shape.units):
        p = place(unit, comp, shard)
        b_param = size_of(comp.dtype or unit.dtype)
        b_frozen = size_of(comp.dtype or unit.frozen_dtype)
        b_reduce = size_of(comp.reduce_dtype if comp.dtype is not None else unit.dtype)
        if shard > 1 and p.params_sharded:
            # hpZ: a block's backward gathers it among its secondary group (the root stays gathered)
            again = "secondary" if comp.reshard_after_forward and shape.units[i].name != "" else shard_label
            for numel, size in ((p.padded, b_param), (p.frozen_padded, b_frozen)):
                if numel:
                    # forward's first gather of a micro-batch waits; the rest are prefetched
                    out.append(Collective(shard_label, "all_gather", numel * size, n, overlapped=i != 0))
                    if i not in kept and (again != "secondary" or comp.reshard_after_forward > 1):
                        out.append(Collective(again, "all_gather", numel * size, n, overlapped=True))
        if not p.padded:
            continue
        if shard > 1:
            if p.grads_sharded:
                kind = "all_reduce" if backend == "gloo" else "reduce_scatter"
                out.append(Collective(shard_label, kind, p.padded * b_reduce, n, overlapped=i != 0))
            else:
                out.append(Collective(shard_label, "all_reduce", p.padded * b_reduce, 1, overlapped=i != 0))
        if replicas > 1:
            home = p.held(p.padded, p.grads_sharded)
            out.append(Collective("replicate", "all_reduce", home * b_reduce, 1, overlapped=i != 0))
        if shard > 1 and not p.params_sharded and p.opt_sharded:
            # the updated slices, gathered back while the next step's forward runs
            out.append(Collective(shard_label, "all_gather", p.padded * b_param, 1, overlapped=True))
    if shard > 1 and any(not p.params_sharded and p.opt_sharded for p in (place(u, comp, shard) for u in shape.units)):
        # before gathering the updated slices, the ranks agree (one float64 flag on the host) that every
        # update went through: over the shard group, or every rank under a mesh
        out.append(Collective("world" if comp.hybrid else shard_label, "all_reduce", 8, 1, overlapped=False))
    for nbytes in shape.buffer_bytes:
        out.append(Collective("world", "broadcast", nbytes, 1, overlapped=False))
    return out


def comm(events: list[Collective]) -> dict:
    """``events`` summed as ``metrics["comm"]`` reports them: ``{label: {kind: {"calls", "bytes"}}}``."""
    out: dict = {}
    for e in events:
        entry = out.setdefault(e.label, {}).setdefault(e.kind, {"calls": 0, "bytes": 0})
        entry["calls"] += e.calls
        entry["bytes"] += e.calls * e.nbytes
    return out
