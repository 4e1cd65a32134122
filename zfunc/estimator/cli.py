"""``python -m zfunc.estimator``: a model's config, a composition and a cluster in, the estimate out
(text, or ``--json``). Rates not given are measured here: the matrix product and memory copy always
can be; a link only between processes (under torchrun), so a cluster of more than one rank per
node needs ``--intra-bandwidth`` when run as one process."""
from __future__ import annotations

import argparse
import json

import torch

from . import Cluster, Composition, Link, estimate
from .probes import compute_rate, link_rate, memory_rate
from .. import dist

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zfunc.estimator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a Hugging Face model's folder or config.json (no download: a local path)")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=sorted(DTYPES), help="mixed_precision's dtype")
    p.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"])
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    p.add_argument("--tokens", type=int, default=2048, help="tokens each rank runs per micro-batch")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (adds attention's operations)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--per-node", type=int, default=None, help="ranks per node (default: this process group's)")
    p.add_argument("--hybrid", action="store_true", help="shard within a node, replicate across nodes")
    for link in ("intra", "inter"):
        p.add_argument(f"--{link}-bandwidth", type=float, default=None,
                       help="a node's collective bus bandwidth, bytes/s" if link == "intra" else
                       "a node's whole network bandwidth (all its NICs), bytes/s")
        p.add_argument(f"--{link}-latency", type=float, default=5e-6, help=f"{link}-node seconds per ring hop")
    p.add_argument("--flops", type=float, default=None, help="a device's FLOP/s (default: measured here)")
    p.add_argument("--memory-rate", type=float, default=None, help="bytes/s of the update (default: measured)")
    p.add_argument("--cpu", action="store_true", help="the devices are CPUs over gloo (default: accelerators, nccl)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def _link(args, which: str) -> Link | None:
    bandwidth = getattr(args, f"{which}_bandwidth")
    if bandwidth is not None:
        return Link(bandwidth, getattr(args, f"{which}_latency"))
    return None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    dist.init()
    here = dist.world_size()
    per_node = args.per_node or here
    intra = _link(args, "intra")
    if intra is None:
        if per_node > 1 and here < 2:
            parser().error(f"--per-node {per_node}: give --intra-bandwidth, or run under torchrun with "
                           f"--nproc-per-node {per_node} to measure the link")
        intra = link_rate() if here > 1 else Link(float("inf"), 0.0)
    inter = _link(args, "inter") or (intra if args.nodes > 1 else None)
    cluster = Cluster(args.nodes, per_node, intra, inter, flops=args.flops or compute_rate(),
                      memory_rate=args.memory_rate or memory_rate(), accelerator=not args.cpu,
                      backend="gloo" if args.cpu else "nccl")
    comp = Composition(stage=args.stage, dtype=DTYPES[args.precision], offload=None if args.offload == "none"
                       else args.offload, accumulate=args.accumulate, micro_batch_tokens=args.tokens,
                       hybrid=args.hybrid)
    result = estimate(args.config, comp, cluster, seq_len=args.seq_len)
    if dist.rank() == 0:
        if args.json:
            print(json.dumps({"memory": result.memory, "comm": result.comm, "links": result.links,
                              "time": result.time}, indent=1))
        else:
            print(result.describe())
    dist.shutdown()
    return 0
