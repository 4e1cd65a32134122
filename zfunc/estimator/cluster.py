"""The machines a run is estimated on: N nodes of G devices, their links and rates, as plain data."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link's alpha-beta model: ``bandwidth`` bytes/s each rank moves through it (a ring's bus
    bandwidth, as nccl-tests' busbw reports it) and ``latency`` seconds each ring hop adds."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"Link: bandwidth must be > 0 bytes/s and latency >= 0 s, got {self}")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``per_node`` ranks. ``intra``: the bus bandwidth of a collective among a node's
    devices (NVLink; here, shared memory); ``inter``: a node's whole network bandwidth (all its NICs:
    8 x 400 Gb/s is 400 GB/s), which a collective spanning nodes gets all of (NCCL runs a ring per
    NIC) while the ``per_node`` replicate groups of a mesh, all reducing at once, share it. ``flops``: a device's
    sustained rate on the model's matrix products (FLOP/s); ``memory_rate``: bytes/s the optimizer's
    update streams through (the memory its state lives in). ``accelerator``: whether the devices
    are accelerators (else host memory is the device's, as ``memory_report`` counts it).
    ``backend``: ``"nccl"`` or ``"gloo"`` (which issues a gradient's reduce-scatter as an all-reduce of
    the whole buffer: zfunc.dist's ``reduce_scatter_mean_start``, about twice as fast there)."""

    nodes: int
    per_node: int
    intra: Link
    inter: Link | None = None
    flops: float = 1e12
    memory_rate: float = 1e10
    accelerator: bool = True
    backend: str = "nccl"

    def __post_init__(self):
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"Cluster.backend must be 'nccl' or 'gloo', got {self.backend!r}")
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Cluster.{name} must be a positive int, got {value!r}")
        if self.nodes > 1 and self.inter is None:
            raise ValueError(f"Cluster: {self.nodes} nodes need the link between them (inter=Link(bandwidth, "
                             "latency)), or measure it (zfunc.estimator.probes)")
        if not self.flops > 0 or not self.memory_rate > 0:
            raise ValueError(f"Cluster: flops and memory_rate must be > 0, got {self.flops}, {self.memory_rate}")

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def crosses_nodes(self, label: str) -> bool:
        """Whether a group's ring crosses nodes: ``"replicate"`` does; ``"world"`` (flat) does once
        there is more than one node; ``"shard"`` stays in a node."""
        return label == "replicate" or (label == "world" and self.nodes > 1)

    def link(self, label: str) -> Link:
        """The link a group's ring is bound by: a node's own within it; across nodes, the slower of
        the node's link and its network for a flat group, a ``per_node``-th of the network for each
        of the replicate groups that reduce together."""
        if not self.crosses_nodes(label):
            return self.intra
        if label == "replicate":
            return Link(self.inter.bandwidth / self.per_node, self.inter.latency)
        return Link(min(self.intra.bandwidth, self.inter.bandwidth), max(self.intra.latency, self.inter.latency))

    def group_size(self, label: str, comp) -> int:
        """Ranks in the group ``label`` names under the composition ``comp``."""
        sizes = {"world": self.world, "shard": self.per_node if comp.hybrid else self.world,
                 "replicate": self.nodes, "secondary": comp.reshard_after_forward or 1}
        return sizes[label]

    def check(self, comp) -> None:
        """Raise where ``comp`` cannot lay out on this cluster."""
        shard = self.per_node if comp.hybrid else self.world
        k = comp.reshard_after_forward
        if k is not None and (shard % k or k > self.per_node):
            raise ValueError(f"reshard_after_forward={k}: the secondary group must divide the shard group ({shard} "
                             f"ranks) and stay within a node ({self.per_node} ranks)")
