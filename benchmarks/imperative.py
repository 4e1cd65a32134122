"""The engine's imperative loop against train_batch, in the same run, on the same micro-batches.

    python benchmarks/imperative.py            # W = 2 gloo ranks, ZeRO-3, a 4-layer width-256 GPT, seq 128
    python benchmarks/imperative.py --small    # smoke test

Each rank builds two engines from the same initial weights: one driven as DeepSpeed scripts
drive theirs (per micro-batch ``logits = engine(x); engine.backward(lm_loss(logits, y));
engine.step()``), one by ``engine.train_batch`` with ``loss_fn``. Timed steps alternate between
the two, each going first every other step (so drift on a shared machine hits both alike), both
on the same ``gradient_accumulation_steps`` micro-batches; a step's time is the slowest rank's.
The two must take the same steps: the output says whether their losses and weights are equal.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, launch  # noqa: E402
from _peers import lm_loss  # noqa: E402
from gpt import GPT, GPTConfig, num_params, rank_generator  # noqa: E402

import zfunc as zf  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--gas", type=int, default=2, help="micro-batches per step")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--small", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq, args.steps, args.warmup = 2, 64, 256, 32, 3, 1
    return args


def engine_for(args, loss_fn=None):
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                    n_heads=args.heads)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.gas,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": {"stage": args.stage}}
    n = num_params(model)
    return zf.initialize(model, config, loss_fn=loss_fn), n


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(args):
    torch.set_num_threads(args.threads)
    zf.dist.init()
    rank = int(os.environ["RANK"])
    imperative, n = engine_for(args)
    batched, _ = engine_for(args, loss_fn=lambda model, b: lm_loss(model(b[0]), b[1]))
    g = rank_generator(1, rank)
    times = {"imperative": [], "train_batch": []}
    losses = {"imperative": [], "train_batch": []}
    for step in range(args.warmup + args.steps):
        micro = []
        for _ in range(args.gas):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            micro.append((tokens[:, :-1], tokens[:, 1:]))
        def run_imperative():
            for x, y in micro:
                imperative.backward(lm_loss(imperative(x), y))
                imperative.step()

        loops = {"imperative": run_imperative, "train_batch": lambda: batched.train_batch(iter(micro))}
        for name in sorted(loops, reverse=step % 2 == 1):  # each goes first every other step
            dist.barrier()
            t0 = time.perf_counter()
            loops[name]()
            seconds = slowest(time.perf_counter() - t0)
            if step >= args.warmup:
                times[name].append(seconds)
        losses["imperative"].append(float(imperative.last_metrics["loss"]))
        losses["train_batch"].append(float(batched.last_metrics["loss"]))
    pa, pb = imperative.params(), batched.params()
    same = all(torch.equal(pa[k], pb[k]) for k in pa)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"times": times, "losses": losses, "same_weights": same, "params": n}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(args):
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        argv = [os.path.abspath(__file__), *sys.argv[1:], "--worker", "--result", result]
        codes = launch(argv, args.world, env={"OMP_NUM_THREADS": str(args.threads)}, timeout=args.timeout)
        if any(codes):
            sys.exit(f"a rank failed: exit codes {codes}")
        with open(result) as f:
            r = json.load(f)
    imp, tb = (statistics.median(r["times"][k]) for k in ("imperative", "train_batch"))
    print(f"GPT {r['params'] / 1e6:.2f} M parameters ({args.layers} layers, width {args.width}, seq {args.seq}, "
          f"vocab {args.vocab}), W = {args.world}, ZeRO-{args.stage}, {args.gas} micro-batches of {args.batch} "
          f"sequences per rank, {args.threads} thread(s) per rank; median of {args.steps} timed steps, slowest rank")
    print(f"| loop | step ms |\n| --- | --- |\n| train_batch | {tb * 1e3:.1f} |\n"
          f"| engine(x); engine.backward(loss); engine.step() | {imp * 1e3:.1f} |")
    print(f"imperative / train_batch: {imp / tb:.3f}x")
    equal = r["losses"]["imperative"] == r["losses"]["train_batch"] and r["same_weights"]
    print("same steps (losses and weights equal): " + ("yes" if equal else "NO: the two loops diverged"))


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
