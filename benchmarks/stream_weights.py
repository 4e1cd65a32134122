"""Streaming a trainer's weights into an inference engine's copy: ``zf.iter_weights`` against a
whole-model gather and FSDP2's per-parameter ``full_tensor()``, with a memory copy as the bound.

    python benchmarks/stream_weights.py                              # a 0.3B Llama, W = 2 gloo ranks
    python benchmarks/stream_weights.py --layers 2 --width 128 --vocab 512    # smoke test

Every rank holds the trainer's sharded state and a plain copy of the model in ``--dtype`` (the
engine's weights, allocated before the baseline), and refreshes the copy, each way in fresh
processes:

* ``iter_weights``: ``for name, t in zf.iter_weights(state, dtype=, bucket_bytes=): engine[name].copy_(t)``
  (zero3 state; one unit gathered at a time, handed out in buckets);
* ``gather_params``: ``zf.gather_params(state)`` (the whole model in fp32 on every rank), then the copy;
* ``fsdp2``: the model under ``fully_shard`` (each decoder layer and the root), and for each
  parameter ``p.full_tensor()`` copied in (what TRL does to sync a vLLM engine from FSDP2);
* ``copy``: the same bytes copied from one resident buffer into the engine's: the memory's bound.

Reported: seconds (the slowest rank's, median of ``--repeats`` after the first), GB/s of the
engine's weights written, and the largest rank's peak RSS above its RSS before the first refresh
(later ones reuse the memory the first left resident in the allocator).
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
sys.path.insert(0, HERE)
from _launch import driver_or_worker, each_in_fresh_processes  # noqa: E402
from _llama import llama  # noqa: E402

import zfunc as zf  # noqa: E402
from zfunc.testing import memory  # noqa: E402

WAYS = ("iter_weights", "gather_params", "fsdp2", "copy")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def refresher(way: str, args, engine: dict):
    """``refresh()``: one refresh of ``engine`` (name -> tensor) the ``way`` way."""
    dtype = DTYPES[args.dtype]
    if way == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = llama(args, "cpu")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        named = list(model.named_parameters())

        def refresh():
            with torch.no_grad():
                for name, p in named:
                    engine[name].copy_(p.full_tensor())
        return refresh
    if way == "copy":
        source = {n: t.clone() for n, t in engine.items()}

        def refresh():
            with torch.no_grad():
                for name, t in source.items():
                    engine[name].copy_(t)
        return refresh
    with torch.device("meta"):
        model = llama(args, "meta")
    torch.manual_seed(0)
    state = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1))).init(model)
    if way == "iter_weights":
        bucket = int(args.bucket_mb * 2**20)

        def refresh():
            with torch.no_grad():
                for name, t in zf.iter_weights(state, dtype=dtype, bucket_bytes=bucket):
                    if name in engine:
                        engine[name].copy_(t)
        return refresh

    def refresh():
        with torch.no_grad():
            for name, t in zf.gather_params(state).items():
                engine[name].copy_(t)
    return refresh


def worker(args) -> None:
    way, out = args.worker.split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine_model = llama(args, "meta").to_empty(device="cpu").to(DTYPES[args.dtype])
    engine = dict(engine_model.named_parameters())  # the tied head once, as the stream hands it
    refresh = refresher(way, args, engine)
    dist.barrier()
    before = memory.rss()
    memory.reset_peak()
    refresh()  # the first: its peak is the memory a refresh needs (later ones reuse what it left resident)
    peak = torch.tensor([memory.peak() - before], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        refresh()
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(seconds.item())
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for t in engine.values())
        params = sum(t.numel() for t in engine.values())
        with open(out, "w") as f:
            json.dump({"seconds": statistics.median(times), "peak": peak.item(), "bytes": nbytes, "params": params}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(args):
    rows = each_in_fresh_processes(args.ways.split(","), __file__, sys.argv[1:], args.world,
                                   env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    first = next(iter(rows.values()))
    print(f"Llama, {first['params'] / 1e6:.0f}M parameters ({args.layers} layers, width {args.width}, vocab "
          f"{args.vocab}), W = {args.world} gloo ranks, engine copy in {args.dtype} ({first['bytes'] / 2**30:.2f} GiB), "
          f"buckets of {args.bucket_mb:g} MiB; median of {args.repeats} refreshes after the first, whose peak RSS is shown")
    copy = rows.get("copy")
    print("| way | seconds | GB/s | x copy's bandwidth | peak RSS added (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for way, r in rows.items():
        rate = r["bytes"] / r["seconds"] / 1e9
        share = f"{copy['seconds'] / r['seconds']:.2f}" if copy else "-"
        print(f"| {way} | {r['seconds']:.3f} | {rate:.2f} | {share} | {r['peak'] / 2**20:.0f} |")


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
