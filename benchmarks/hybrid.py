"""Hybrid sharding at W = 4 (2 x 2) over gloo: zfunc flat, hybrid and hpZ against FSDP2 flat and HSDP
and DeepSpeed ZeRO-3 and MiCS, with the estimator's prediction beside each zfunc row.

    python benchmarks/hybrid.py            # the GPT of examples/gpt.py, 4 layers, d_model 256, W = 4
    python benchmarks/hybrid.py --small    # smoke test
    python benchmarks/hybrid.py --peers zfunc,zfunc-hybrid --json out.json

Each peer runs in its own fresh set of W processes (benchmarks/_launch.py), built by
benchmarks/_peers.py on the same model (seed 0), the same batches (rank r's from rank_generator),
AdamW, fp32:

* ``zfunc``: ``zf.zero3(step)`` over the world; ``zfunc-hybrid``: ``zf.zero3(step,
  mesh=zf.dist.mesh(shard=2))``; ``zfunc-hpz``: ``zf.zero3(step, reshard_after_forward=2)``;
* ``fsdp2``: ``fully_shard`` per block + root over a 1-D mesh; ``fsdp2-hsdp``: the same over
  ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`` (torch's HSDP);
* ``ds3``: DeepSpeed ZeRO-3; ``ds-mics``: the same with ``"mics_shard_size": 2`` (DeepSpeed's
  MiCS); torch AdamW, DS_ACCELERATOR=cpu. A peer that cannot run here gets its error in its row.

Measured per peer: the median step time (each step starts at a barrier and ends on the slowest
rank; the warm-up left out), the peak RSS per rank (the largest rank's high-water mark, and above
its RSS before the model existed), the final loss (the ranks' mean), and the bytes each mesh dim
carries per step (the last step's; rank 0's): for zfunc its own ``metrics["comm"]`` (data kinds
only: the agreement's few bytes left out), for the peers a shim around torch.distributed's
collectives installed before the peer is built (``CollectiveCounter``: all-gathers, reduce-
scatters, all-reduces, broadcasts, reduces, all-to-alls, by the global ranks of their group:
the world, consecutive pairs "shard", strided pairs "replicate"), both in nccl-tests' convention
(a collective's whole buffer). The shim counts zfunc's collectives too: the JSON keeps both.

The estimate: ``zf.estimate(GPT on the meta device, Composition(stage=3, hybrid=...,
reshard_after_forward=...), Cluster(..., backend="gloo"), overlap=False)`` from rates each zfunc
peer measures in its own processes right after its steps (a 512 x 512 matrix product's FLOP/s, a
copy's bytes/s, the gloo all-reduce of the world, of the shard pairs and of the replicate pairs,
each pair measured while the other pair runs too): flat as 1 node x 4, hybrid as 2 nodes x 2 (the
replicate link the measured pair's bandwidth x 2, as the estimator gives each of a node's
replicate groups a per_node-th of the network).
"""
import argparse
import json
import os
import statistics
import sys
import threading

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, each_in_fresh_processes, gpt_args  # noqa: E402
from _peers import (Settings, _deepspeed_train, _torch_train, build, deepspeed_engine, ds_config, fsdp2,  # noqa: E402
                    init_distributed, lm_loss, torch_adamw)
from _worker import finish, timed_steps  # noqa: E402
from gpt import GPT, GPTConfig, num_params, rank_generator  # noqa: E402

import zfunc as zf  # noqa: E402
from zfunc.testing import memory  # noqa: E402

# peer -> (what its row says, the _peers name it is built from)
PEERS = {
    "zfunc": ("zfunc zero3, flat over W = 4", "zero3"),
    "zfunc-hybrid": ("zfunc zero3(mesh=zf.dist.mesh(shard=2)), 2 x 2", "zero3"),
    "zfunc-hpz": ("zfunc zero3(reshard_after_forward=2), flat", "zero3"),
    "fsdp2": ("FSDP2, fully_shard per block + root, 1-D mesh", "fsdp2"),
    "fsdp2-hsdp": ("FSDP2 HSDP, 2-D mesh (replicate 2, shard 2)", "fsdp2"),
    "ds3": ("DeepSpeed ZeRO-3", "ds3"),
    "ds-mics": ("DeepSpeed MiCS (mics_shard_size 2)", "ds3"),
}
DIMS = ("world", "shard", "replicate", "secondary")
DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all", "send", "recv")
FP32_TOLERANCE = 1e-5
WORLD, SHARD = 4, 2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return gpt_args(p, PEERS, timeout=300, extra=[("--lr", {"type": float, "default": 1e-3})])


def gpt_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                     n_heads=args.heads, tie_embeddings=False)


# -----------------------------------------------------------------------------
# worker: one peer on one rank


class CollectiveCounter:
    """Bytes and calls of torch.distributed's collectives this process issues, by the ranks of their
    group, in nccl-tests' convention (an all-gather's output, a reduce-scatter's input, the tensor
    of the others). Wraps the functions in torch.distributed and its distributed_c10d module (where
    all_gather_into_tensor and _all_gather_base call all_gather_single by its global name); a call
    inside a counted one is not counted again. Counts only while ``on``."""

    WRAPPED = {  # torch.distributed function -> (kind, bytes of its arguments)
        "all_gather_single": ("all_gather", lambda a, kw: _nbytes(a[0] if a else kw["output_tensor"])),
        "all_gather": ("all_gather", lambda a, kw: sum(_nbytes(t) for t in (a[0] if a else kw["tensor_list"]))),
        "reduce_scatter_single": ("reduce_scatter", lambda a, kw: _nbytes(a[1] if len(a) > 1 else kw["input"])),
        "reduce_scatter": ("reduce_scatter", lambda a, kw: sum(_nbytes(t) for t in (a[1] if len(a) > 1
                                                                                     else kw["input_list"]))),
        "all_reduce": ("all_reduce", lambda a, kw: _nbytes(a[0] if a else kw["tensor"])),
        "all_reduce_coalesced": ("all_reduce", lambda a, kw: sum(_nbytes(t) for t in (a[0] if a else kw["tensors"]))),
        "broadcast": ("broadcast", lambda a, kw: _nbytes(a[0] if a else kw["tensor"])),
        "reduce": ("reduce", lambda a, kw: _nbytes(a[0] if a else kw["tensor"])),
        "all_to_all_single": ("all_to_all", lambda a, kw: _nbytes(a[1] if len(a) > 1 else kw["input"])),
    }

    def __init__(self):
        self.on, self.counts, self._inside = False, {}, threading.local()
        c10d = dist.distributed_c10d
        for name, (kind, size) in self.WRAPPED.items():
            orig = getattr(c10d, name, None)
            if orig is None:  # a name this torch does not have
                continue
            wrapped = self._wrap(orig, kind, size, self._group_arg(name))
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    @staticmethod
    def _group_arg(name):
        import inspect

        params = list(inspect.signature(getattr(dist.distributed_c10d, name)).parameters)
        return params.index("group")

    def _wrap(self, orig, kind, size, group_at):
        def wrapped(*a, **kw):
            if not self.on or getattr(self._inside, "depth", 0):
                return orig(*a, **kw)
            group = kw.get("group", a[group_at] if len(a) > group_at else None)
            entry = self.counts.setdefault(label(group), {}).setdefault(kind, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += size(a, kw)
            self._inside.depth = 1
            try:
                return orig(*a, **kw)
            finally:
                self._inside.depth = 0
        wrapped.__wrapped__ = orig
        return wrapped

    def take(self) -> dict:
        counts, self.counts = self.counts, {}
        return counts


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def label(group) -> str:
    """The mesh dim a group of the 2 x 2 layout is: the world, a consecutive pair ("shard"), a
    strided one ("replicate"); else its global ranks."""
    ranks = sorted(dist.get_process_group_ranks(group or dist.group.WORLD))
    if len(ranks) == dist.get_world_size():
        return "world"
    if len(ranks) == SHARD and ranks[1] - ranks[0] == 1 and ranks[0] % SHARD == 0:
        return "shard"
    if len(ranks) == WORLD // SHARD and all(b - a == SHARD for a, b in zip(ranks, ranks[1:])):
        return "replicate"
    return f"ranks{tuple(ranks)}"


def data_bytes(comm: dict) -> dict:
    """``{dim: {kind: {calls, bytes}}}`` less the control kinds (agreement, barrier)."""
    return {g: {k: v for k, v in kinds.items() if k in DATA_KINDS} for g, kinds in comm.items()
            if any(k in DATA_KINDS for k in kinds)}


def build_peer(peer, model, loss, s: Settings, on_metrics):
    """``train(micro_batches)`` of ``peer`` (benchmarks/_peers.py's builders)."""
    name = PEERS[peer][1]
    if peer == "zfunc-hybrid":
        s.coordinator = {"mesh": zf.dist.mesh(shard=SHARD)}
    if peer == "zfunc-hpz":
        s.coordinator = {"reshard_after_forward": SHARD}
    if peer == "fsdp2-hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD // SHARD, SHARD), mesh_dim_names=("replicate", "shard"))
        fsdp2(model, model.blocks, mesh)
        return _torch_train(model, torch_adamw(model.parameters(), s), loss)
    if peer == "ds-mics":
        config = ds_config(name, s)
        config["zero_optimization"]["mics_shard_size"] = SHARD
        return _deepspeed_train(deepspeed_engine(name, model, model.blocks, s, config=config), loss)
    return build(name, model, model.blocks, loss, s, on_metrics=on_metrics)


def measure_rates() -> dict:
    """This machine's rates as the estimator takes them, every rank measuring at once."""
    from zfunc.estimator import probes

    mesh = zf.dist.mesh(shard=SHARD)
    links = {dim: probes.link_rate(group, large=1 << 20)
             for dim, group in (("world", None), ("shard", mesh.get_group("shard")),
                                ("replicate", mesh.get_group("replicate")))}
    return {"flops": probes.compute_rate(n=512), "memory_rate": probes.memory_rate(numel=1 << 22),
            "links": {dim: [link.bandwidth, link.latency] for dim, link in links.items()}}


def worker(args) -> None:
    """Peer ``--worker PEER,OUT`` on this rank; rank 0 writes the result to OUT."""
    peer, out = args.worker.split(",")
    torch.set_num_threads(1)
    counter = CollectiveCounter()  # before DeepSpeed's comm backend or any peer exists
    init_distributed(PEERS[peer][1], "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank:  # one rank's step lines are enough
        sys.stdout = open(os.devnull, "w")
    if world != WORLD:
        sys.exit(f"benchmarks/hybrid.py runs at W = {WORLD} (a 2 x 2 mesh), got W = {world}")
    baseline = memory.rss()
    memory.reset_peak()
    torch.manual_seed(0)  # the same initial weights in every peer and on every rank
    model = GPT(gpt_config(args))
    s = Settings(lr=args.lr, world=world, batch=args.batch)
    comm = []  # zfunc's metrics["comm"], a step each
    result = {"peer": peer, "params": num_params(model)}
    try:
        train = build_peer(peer, model, lambda forward, b: lm_loss(forward(b[0]), b[1]), s,
                           on_metrics=lambda m: comm.append(m.get("comm", {})))
    except Exception as e:  # noqa: BLE001  a peer this machine cannot run: its error is its row
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        dist.barrier()
        finish(out if rank == 0 else os.devnull, result, cuda=False)
    g = rank_generator(0, rank)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    shim = []  # the shim's counts, a step each

    def counted(batch):
        dist.barrier()
        counter.on = True
        try:
            return train([batch])
        finally:
            counter.on = False
            shim.append(counter.take())
    counted.settle = train.settle
    times, losses = timed_steps(counted, batches, cuda=False, warmup=args.warmup)
    if peer.startswith("zfunc"):
        result["rates"] = measure_rates()
    # the slowest rank's time a step, the ranks' mean loss (zfunc's is the mean already), the largest peak
    gathered = torch.tensor([times, losses], dtype=torch.float64)
    slowest = gathered[0].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mean_loss = gathered[1].clone()
    if not peer.startswith("zfunc"):
        dist.all_reduce(mean_loss)
        mean_loss /= world
    peaks = torch.tensor([memory.peak(), memory.peak() - baseline], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    result.update(step_s=slowest[args.warmup:].tolist(), median_step_s=statistics.median(slowest[args.warmup:].tolist()),
                  losses=mean_loss.tolist(), final_loss=mean_loss[-1].item(), peak_rss=peaks[0].item(),
                  peak_above_baseline=peaks[1].item(), shim_comm=shim[-1],
                  zfunc_comm=data_bytes(comm[-1]) if comm else None)
    dist.barrier()
    finish(out if rank == 0 else os.devnull, result, cuda=False)


# -----------------------------------------------------------------------------
# driver: every peer in fresh processes, then the table


def predicted(peer, args, rates):
    """``zf.estimate`` of zfunc peer ``peer`` from the rates it measured."""
    from zfunc.estimator import Cluster, Composition, Link

    links = {dim: Link(*v) for dim, v in rates["links"].items()}
    common = dict(flops=rates["flops"], memory_rate=rates["memory_rate"], accelerator=False, backend="gloo")
    if peer == "zfunc-hybrid":
        rep = links["replicate"]  # each of a node's per_node replicate groups gets a per_node-th of inter
        cluster = Cluster(WORLD // SHARD, SHARD, links["shard"], Link(rep.bandwidth * SHARD, rep.latency), **common)
    else:
        cluster = Cluster(1, WORLD, links["world"], **common)
    comp = Composition(stage=3, micro_batch_tokens=args.batch * args.seq, hybrid=peer == "zfunc-hybrid",
                       reshard_after_forward=SHARD if peer == "zfunc-hpz" else None)
    with torch.device("meta"):
        model = GPT(gpt_config(args))
    return zf.estimate(model, comp, cluster, seq_len=args.seq, overlap=False)


def per_dim(comm: dict | None) -> str:
    """MB per step on each mesh dim, world first."""
    if not comm:
        return "none" if comm == {} else "not counted"
    order = sorted(comm, key=lambda d: (DIMS.index(d) if d in DIMS else len(DIMS), d))
    return "; ".join(f"{d} {sum(v['bytes'] for v in comm[d].values()) / 1e6:.2f}" for d in order)


def table(rows: dict, args) -> tuple[str, list]:
    base = rows.get("zfunc")
    lines = ["| peer | median step s | peak RSS per rank (above baseline) MiB | final loss | rel. diff to zfunc flat "
             "| MB per step by mesh dim, counted | MB per step, estimated | step s, estimated |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    problems = []
    for peer, r in rows.items():
        if "error" in r:
            lines.append(f"| {PEERS[peer][0]} | did not run: `{r['error']}` | | | | | | |")
            continue
        diff = abs(r["final_loss"] - base["final_loss"]) / abs(base["final_loss"]) if base and "error" not in base else None
        if diff is not None and diff > FP32_TOLERANCE:
            problems.append(f"{peer}: final loss {r['final_loss']:.8f}, zfunc flat {base['final_loss']:.8f}: "
                            f"relative difference {diff:.2e} > {FP32_TOLERANCE:g}")
        counted = r["zfunc_comm"] if peer.startswith("zfunc") else r["shim_comm"]
        est_bytes = est_step = ""
        if "rates" in r:
            est = predicted(peer, args, r["rates"])
            est_bytes, est_step = per_dim(est.comm), f"{est.time['step']:.3f}"
        lines.append(f"| {PEERS[peer][0]} | {r['median_step_s']:.3f} | {r['peak_rss'] / 2**20:.0f} "
                     f"({r['peak_above_baseline'] / 2**20:.0f}) | {r['final_loss']:.6f} | "
                     f"{'' if diff is None else f'{diff:.1e}'} | {per_dim(counted)} | {est_bytes} | {est_step} |")
    return "\n".join(lines), problems


def main(args):
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    rows = each_in_fresh_processes(args.peers, __file__, sys.argv[1:], WORLD, env=env, timeout=args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    first = next((r for r in rows.values() if "params" in r), {})
    print(f"\nGPT pre-LN, {args.layers} layers, d_model {args.width}, vocab {args.vocab}, untied, "
          f"{first.get('params', 0) / 1e6:.2f}M parameters; W = {WORLD} gloo ranks x 1 thread, {args.batch} x "
          f"{args.seq} tokens a rank a step, fp32, AdamW (lr {args.lr}, wd 0.01); median of {args.steps} steps "
          f"after {args.warmup}; bytes: the last step's, rank 0's, whole buffers (nccl-tests)\n")
    text, problems = table(rows, args)
    print(text)
    flat, hybrid = rows.get("zfunc"), rows.get("zfunc-hybrid")
    if flat and hybrid and "error" not in flat and "error" not in hybrid:
        gap = abs(flat["final_loss"] - hybrid["final_loss"])
        assert gap <= FP32_TOLERANCE * abs(flat["final_loss"]), (
            f"zfunc hybrid's final loss {hybrid['final_loss']} differs from flat's {flat['final_loss']} by {gap:.2e}")
    if problems:
        print("\nLOSS MISMATCH:\n" + "\n".join(problems))


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
