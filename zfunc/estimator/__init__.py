"""What a run costs before it runs: ``zf.estimate(model, composition, cluster)`` says, for a model
(a Hugging Face config or a module on the meta device) under a composition (ZeRO stage, mixed
precision, offload, accumulation, hybrid sharding) on N nodes x G devices, the memory each rank
holds, the bytes each collective moves per step on each mesh dim, and the step's time from the
devices' rate and an alpha-beta model of each link (given, or measured here: ``probes.measure``).

Memory is exact for the state (``zf.memory_report``'s parts); bytes follow ``metrics["comm"]``;
time is a model whose assumptions zfunc.estimator.timing states (docs/scale.md compares it with
published runs).
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster, Link
from .composition import Composition
from .memory import memory, shard_size
from .model import ModelShape, model_shape
from .probes import measure
from .timing import seconds, step_time, wire_bytes
from .traffic import Collective, collectives, comm

__all__ = ["Cluster", "Composition", "Estimate", "Link", "estimate", "measure", "model_shape"]


@dataclass(frozen=True)
class Estimate:
    """``memory``: bytes per rank (``memory_report``'s parts, ``by_home``, ``grad_bytes``).
    ``comm``: per step, ``{label: {kind: {"calls", "bytes"}}}`` as ``metrics["comm"]``. ``links``:
    per group label, the link it crosses, its ranks, the bytes each rank sends per step and their
    seconds. ``time``: seconds per step (``compute``, ``comm``, ``exposed``, ``update``, ``step``) and
    ``tokens_per_second`` over all ranks."""

    model: ModelShape
    composition: Composition
    cluster: Cluster
    memory: dict
    comm: dict
    links: dict
    time: dict

    def describe(self) -> str:
        c, gib = self.cluster, 2 ** 30
        m, t = self.memory, self.time
        lines = [f"{self.model.trainable / 1e9:.3g}B trainable parameters, {c.nodes} node(s) x {c.per_node} "
                 f"rank(s), ZeRO-{self.composition.stage}" + (" hybrid" if self.composition.hybrid else ""),
                 "memory per rank: " + ", ".join(f"{k} {m['by_home'][k] / gib:.3f} GiB" for k in m["by_home"])
                 + f" (parameters {m['param_bytes'] / gib:.3f}, optimizer {m['optimizer_bytes'] / gib:.3f}, "
                 f"gradients at the update {m['grad_bytes'] / gib:.3f} GiB)"]
        for label, kinds in self.comm.items():
            link = self.links[label]
            lines.append(f"{label} ({link['ranks']} ranks, {link['link']}): " + ", ".join(
                f"{k} {v['calls']} x = {v['bytes'] / gib:.3f} GiB" for k, v in kinds.items())
                + f"; {link['wire_bytes'] / gib:.3f} GiB sent per rank, {link['seconds'] * 1e3:.1f} ms")
        lines.append(f"step {t['step'] * 1e3:.1f} ms: compute {t['compute'] * 1e3:.1f}, communication "
                     f"{t['comm'] * 1e3:.1f} ({t['exposed'] * 1e3:.1f} exposed), update {t['update'] * 1e3:.1f}; "
                     f"{t['tokens_per_second']:,.0f} tokens/s")
        return "\n".join(lines)


def _links(events: list[Collective], comp: Composition, cluster: Cluster) -> dict:
    out: dict = {}
    for e in events:
        ranks = cluster.group_size(e.label, comp)
        link = cluster.link(e.label)
        entry = out.setdefault(e.label, {"link": "inter" if cluster.crosses_nodes(e.label) else "intra", "ranks": ranks,
                                         "wire_bytes": 0.0, "seconds": 0.0})
        entry["wire_bytes"] += e.calls * wire_bytes(e.kind, e.nbytes, ranks)
        entry["seconds"] += e.calls * seconds(e.kind, e.nbytes, ranks, link)
    return out


def estimate(model, composition: Composition | None = None, cluster: Cluster | None = None, *, units=None,
             seq_len: int | None = None, overlap: bool = True) -> Estimate:
    """The cost of training ``model`` under ``composition`` (default: ZeRO-3, fp32) on ``cluster``
    (default: measured here, ``probes.measure()``, over the current process group).

    ``model``: an ``nn.Module`` (build it under ``torch.device("meta")`` for a large one) or a Hugging
    Face config (``PretrainedConfig``, its dict, or a local folder with ``config.json``). ``units``:
    the unit policy, as ``zf.zero3(units=)``. ``seq_len``: adds attention's operations per token.
    ``overlap=False``: no collective hides behind compute."""
    composition = composition or Composition()
    if not isinstance(composition, Composition):
        raise TypeError(f"zf.estimate: composition must be a zfunc.estimator.Composition, got {type(composition).__name__}")
    cluster = cluster or measure()
    if not isinstance(cluster, Cluster):
        raise TypeError(f"zf.estimate: cluster must be a zfunc.estimator.Cluster, got {type(cluster).__name__}")
    cluster.check(composition)
    shard = shard_size(composition, cluster.nodes, cluster.per_node)
    shape = model_shape(model, units=units, shard_size=shard, seq_len=seq_len)
    events = collectives(shape, composition, cluster.nodes, cluster.per_node, cluster.backend)
    time = step_time(shape, composition, cluster, events, overlap=overlap)
    time["tokens_per_second"] = cluster.world * composition.micro_batch_tokens * composition.accumulate / time["step"]
    return Estimate(shape, composition, cluster, memory(shape, composition, shard, cluster.accelerator),
                    comm(events), _links(events, composition, cluster), time)
