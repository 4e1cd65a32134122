"""Muon + AdamW against AdamW under zfunc's zero3 at W = 4 over gloo.

    python benchmarks/muon.py            # the GPT of examples/gpt.py, 4 layers, d_model 256, W = 4
    python benchmarks/muon.py --small    # smoke test

Each optimizer runs in its own fresh set of W processes (benchmarks/_launch.py) on the same model
(seed 0) and batches, fp32, ``zf.zero3(zf.train_step(loss, opt))``:

* ``adamw``: ``zf.optim.adamw(lr, weight_decay=0.01)`` on every parameter;
* ``muon``: ``zf.optim.multi`` of ``zf.optim.muon(0.02, weight_decay=0.01)`` on the blocks' 2-D
  weights and that AdamW on the rest (embeddings, head, norms, biases): the standard recipe, each
  block laid out so that its matrices lie inside the shards (the owner layout, zfunc.tree);
* ``muon-gather``: the same with the owner layout turned off (``zfunc.tree.MAX_OWNER_PADDING = -1``):
  the shards cut the matrices, and each block's unit is gathered to the owners;
* ``ds-adamw``, ``ds-muon``: DeepSpeed 0.19.8's ZeRO-3 on the CPU (``DS_ACCELERATOR=cpu``, gloo):
  torch AdamW, and its ``"type": "Muon"`` (``MuonWithAuxAdam``: Muon on the parameters tagged
  ``use_muon``, the same blocks' matrices, its auxiliary torch AdamW on the rest, ``muon_lr`` 0.02,
  ``adam_lr`` 1e-3, ``reduce_scatter`` off as its Muon requires). Its update time is ``engine.step()``'s
  (the partitioned update and the parameters' copies); its collectives are not counted (n/a).

Measured per optimizer: the median step time (each step starts at a barrier and ends on the slowest
rank; the warm-up left out), the optimizer's share of it (its update, timed on each rank, the
slowest rank's), the bytes per collective kind of the last step (rank 0's ``metrics["comm"]``:
whole buffers, nccl-tests' convention), the optimizer state a rank holds (``zf.memory_report``'s
``optimizer_bytes``, the largest rank's; DeepSpeed's: its optimizer's state tensors on the rank) and
the peak RSS (the largest rank's high-water mark); for Muon, Newton-Schulz's own seconds a step (the
slowest rank's ``newton_schulz`` calls).

The ratios printed after the table are the issue's aims (issue 49): Muon's collective bytes per kind
over AdamW's; Muon's step over AdamW's plus Newton-Schulz's seconds (at most 1.1); the state a rank
holds over an even share of the ideal state (AdamW's 8 B per AdamW parameter and Muon's 4 B per
matrix element, over W) plus the largest matrix's 4 B per element (at most 1.3).

    python benchmarks/muon.py --json muon.json    # all five rows

``--small`` took 92 s on a loaded 2-core VM, most of it each DeepSpeed row's first step building its
shm comm op (about 40 s); the full model's Muon rows run Newton-Schulz in bf16 on the CPU (about
1-3 s a step there, 8 steps a row).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, each_in_fresh_processes, gpt_args  # noqa: E402
from _worker import finish, timed_steps  # noqa: E402
from gpt import GPT, GPTConfig, num_params, rank_generator  # noqa: E402

import zfunc as zf  # noqa: E402
import zfunc.tree  # noqa: E402
from zfunc.testing import memory  # noqa: E402

PEERS = {"adamw": "AdamW on every parameter", "muon": "Muon on the blocks' matrices + AdamW on the rest",
         "muon-gather": "the same without the owner layout (each block's unit gathered to the owners)",
         "ds-adamw": "DeepSpeed ZeRO-3 (CPU), torch AdamW on every parameter",
         "ds-muon": "DeepSpeed ZeRO-3 (CPU), its Muon (MuonWithAuxAdam) on the blocks' matrices + AdamW"}
WORLD = 4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return gpt_args(p, PEERS, timeout=600)


def hidden(name: str) -> bool:
    """The recipe's Muon parameters in examples/gpt.py's GPT: its blocks' 2-D weights."""
    return name.startswith("blocks.") and name.endswith(".weight") and ".ln" not in name


def optimizer(peer: str):
    adamw = zf.optim.adamw(1e-3, weight_decay=0.01)
    if peer == "adamw":
        return adamw
    return zf.optim.multi({"muon": zf.optim.muon(0.02, weight_decay=0.01), "adamw": adamw},
                          lambda name: "muon" if hidden(name) else "adamw")


def timed(opt, seconds: list):
    """``opt`` with each update's seconds appended to ``seconds``."""
    def update(*a, **kw):
        start = time.perf_counter()
        out = opt.update(*a, **kw)
        seconds.append(time.perf_counter() - start)
        return out
    return opt._replace(update=update)


def ns_timed(seconds: list):
    """zfunc's Newton-Schulz with each call's seconds appended to ``seconds`` (muon.py calls it by name)."""
    muon_module = sys.modules["zfunc.optim.muon"]
    original = muon_module.newton_schulz

    def newton_schulz(*a, **kw):
        start = time.perf_counter()
        out = original(*a, **kw)
        seconds.append(time.perf_counter() - start)
        return out
    muon_module.newton_schulz = newton_schulz


def begin_worker(args, peer: str, init_group) -> tuple:
    """What every worker does first: one thread, the process group (``init_group()``), rank 0's output
    only, the RSS peak reset, the GPT built with seed 0; returns it and its result row begun."""
    torch.set_num_threads(1)
    init_group()
    if dist.get_rank():
        sys.stdout = open(os.devnull, "w")
    memory.reset_peak()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                    n_heads=args.heads, tie_embeddings=False)
    model = GPT(cfg)
    return model, {"peer": peer, "params": num_params(model),
                   "muon_params": sum(p.numel() for n, p in model.named_parameters() if hidden(n))}


def ds_worker(args, peer: str, out: str) -> None:
    """DeepSpeed's ZeRO-3 on the CPU over gloo: AdamW, or its Muon with the auxiliary AdamW."""
    import deepspeed

    model, result = begin_worker(args, peer, lambda: deepspeed.init_distributed(dist_backend="gloo"))
    rank = dist.get_rank()
    if peer == "ds-muon":
        for n, p in model.named_parameters():
            p.use_muon = hidden(n)
        opt = {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01,
                                          "momentum": 0.95, "torch_adam": True}}
    else:
        opt = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
    config = {"train_micro_batch_size_per_gpu": args.batch, "optimizer": opt, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "reduce_scatter": peer != "ds-muon"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = rank_generator(0, rank)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    update_s: list = []

    def train(batch):
        dist.barrier()
        logits = engine(batch[0])
        value = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
        engine.backward(value)
        start = time.perf_counter()
        engine.step()
        update_s.append(time.perf_counter() - start)
        return value.detach()

    train.settle = lambda: None
    times, losses = timed_steps(train, batches, cuda=False, warmup=args.warmup)
    gathered = torch.tensor([times, update_s], dtype=torch.float64)
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state_bytes = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor))
    for name in ("muon_momentum_buffer_partitioned_groups_flat",):  # kept beside the torch state when in memory
        for t in (getattr(engine.optimizer, name, None) or {}).values():
            state_bytes += t.numel() * t.element_size()
    sizes = torch.tensor([state_bytes, memory.peak()], dtype=torch.float64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    result.update(median_step_s=statistics.median(gathered[0, args.warmup:].tolist()),
                  median_update_s=statistics.median(gathered[1, args.warmup:].tolist()),
                  final_loss=losses[-1], optimizer_bytes=sizes[0].item(), peak_rss=sizes[1].item(), comm={},
                  comm_calls={}, ns_s=None, largest_matrix=max(p.numel() for n, p in model.named_parameters()
                                                                if hidden(n)))
    dist.barrier()
    finish(out if rank == 0 else os.devnull, result, cuda=False)


def worker(args) -> None:
    peer, out = args.worker.split(",")
    if peer.startswith("ds-"):
        return ds_worker(args, peer, out)
    model, result = begin_worker(args, peer, lambda: zf.dist.init("gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()

    def loss_fn(params, b):
        logits = zf.apply(model, params, b[0])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[1].flatten())

    if peer == "muon-gather":
        zfunc.tree.MAX_OWNER_PADDING = -1.0
    update_s: list = []
    ns_s: list = []
    ns_timed(ns_s)
    step = zf.zero3(zf.train_step(loss_fn, timed(optimizer(peer), update_s)))
    state = step.init(model)
    g = rank_generator(0, rank)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    comm, ns_step = [], []

    def train(batch):
        nonlocal state
        dist.barrier()
        before = len(ns_s)
        state, metrics = step(state, batch)
        ns_step.append(sum(ns_s[before:]))
        comm.append(metrics.get("comm", {}))
        return metrics["loss"]

    train.settle = lambda: None
    times, losses = timed_steps(train, batches, cuda=False, warmup=args.warmup)
    gathered = torch.tensor([times, update_s, ns_step], dtype=torch.float64)
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    report = zf.memory_report(state)
    sizes = torch.tensor([report["optimizer_bytes"], memory.peak()], dtype=torch.float64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    kinds = {}
    for dims in comm[-1].values():
        for kind, c in dims.items():
            if kind != "agreement":
                kinds[kind] = kinds.get(kind, 0) + c["bytes"]
    result.update(median_step_s=statistics.median(gathered[0, args.warmup:].tolist()),
                  median_update_s=statistics.median(gathered[1, args.warmup:].tolist()),
                  ns_s=statistics.median(gathered[2, args.warmup:].tolist()),
                  largest_matrix=max(p.numel() for n, p in model.named_parameters() if hidden(n)),
                  final_loss=losses[-1], optimizer_bytes=sizes[0].item(), peak_rss=sizes[1].item(), comm=kinds,
                  comm_calls={k: sum(c["calls"] for d in comm[-1].values() for kk, c in d.items() if kk == k)
                              for k in kinds})
    dist.barrier()
    finish(out if rank == 0 else os.devnull, result, cuda=False)


def main(args):
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
    rows = each_in_fresh_processes(args.peers, __file__, sys.argv[1:], WORLD, env=env, timeout=args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    first = next(iter(rows.values()))
    print(f"\nGPT pre-LN, {args.layers} layers, d_model {args.width}, vocab {args.vocab}, untied, "
          f"{first['params'] / 1e6:.2f}M parameters ({first['muon_params'] / 1e6:.2f}M in the blocks' matrices); "
          f"zero3, W = {WORLD} gloo ranks x 1 thread, {args.batch} x {args.seq} tokens a rank a step, fp32; "
          f"median of {args.steps} steps after {args.warmup}\n")
    kinds = sorted({k for r in rows.values() for k in r["comm"]})
    print("| optimizer | step s | update s | Newton-Schulz s | " + " | ".join(f"{k} MiB (calls)" for k in kinds)
          + " | optimizer state MiB/rank | peak RSS MiB | final loss |")
    print("| --- " * (7 + len(kinds)) + "|")
    for peer, r in rows.items():
        cells = [f"{r['comm'].get(k, 0) / 2**20:.1f} ({r['comm_calls'].get(k, 0)})" if r["comm"] else "n/a"
                 for k in kinds]
        ns = "-" if not r.get("ns_s") else f"{r['ns_s']:.4f}"
        print(f"| {PEERS[peer]} | {r['median_step_s']:.3f} | {r['median_update_s']:.4f} | {ns} | " + " | ".join(cells)
              + f" | {r['optimizer_bytes'] / 2**20:.1f} | {r['peak_rss'] / 2**20:.0f} | {r['final_loss']:.4f} |")
    print()
    for line in ratios(rows):
        print(line)


def ratios(rows: dict) -> list[str]:
    """The issue's aims, as measured (module docstring)."""
    out = []
    first = next(iter(rows.values()))
    params, matrices = first["params"], first["muon_params"]
    ideal = (8 * (params - matrices) + 4 * matrices) / WORLD + 4 * first["largest_matrix"]
    for peer in ("muon", "muon-gather", "ds-muon"):
        r = rows.get(peer)
        if r is None:
            continue
        out.append(f"{peer}: state per rank / (even share of the ideal + the largest matrix) = "
                   f"{r['optimizer_bytes']:.0f} / {ideal:.0f} = {r['optimizer_bytes'] / ideal:.2f} (aim <= 1.3)")
        base = rows.get("ds-adamw" if peer.startswith("ds-") else "adamw")
        if base is None:
            continue
        ns = r.get("ns_s") or 0.0
        name = "ds-adamw" if peer.startswith("ds-") else "adamw"
        out.append(f"{peer}: step / ({name}'s step + Newton-Schulz) = {r['median_step_s']:.3f} / "
                   f"({base['median_step_s']:.3f} + {ns:.3f}) = {r['median_step_s'] / (base['median_step_s'] + ns):.2f}"
                   " (aim <= 1.1" + ("; DeepSpeed's Newton-Schulz not timed: 0)" if peer.startswith("ds-") else ")"))
        if r["comm"] and base["comm"]:
            cells = ", ".join(f"{k} {r['comm'].get(k, 0) / max(base['comm'].get(k, 0), 1):.2f}x"
                              for k in sorted(set(r["comm"]) | set(base["comm"])))
            out.append(f"{peer}: collective bytes over adamw's, per kind: {cells} (aim: 1.00x)")
    if "muon" in rows and "ds-muon" in rows:
        a, b = rows["muon"], rows["ds-muon"]
        out.append(f"zfunc muon against DeepSpeed's: step {a['median_step_s'] / b['median_step_s']:.2f}x, "
                   f"state per rank {a['optimizer_bytes'] / b['optimizer_bytes']:.2f}x, "
                   f"peak RSS {a['peak_rss'] / b['peak_rss']:.2f}x")
    return out


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
