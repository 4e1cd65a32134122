"""Soak: resident memory per rank over a long run, zfunc zero3 (with and without offload_nvme)
against torch DDP, in one run.

    python benchmarks/soak.py                          # 2,000 steps, W=2 gloo ranks, a tiny model
    python benchmarks/soak.py --steps 5000 --every 250
    python benchmarks/soak.py --fr-buffer 0            # torch's flight recorder off (see below)

Each mode runs in its own fresh W processes (benchmarks/_launch.py), built by
benchmarks/_peers.py; every rank reads its RSS (zfunc.testing.memory) every --every steps. The table gives rank 0's and the other ranks' RSS
at each sample, then per mode the growth over the first and the second half of the run.
A leak grows in both halves alike; a bounded cache filling up grows in the first only.

Bounded growth any distributed run shows, and what it is:

* torch's c10d flight recorder keeps the last TORCH_FR_BUFFER_SIZE collectives (default 2000),
  each with the Python stack that issued it, about 1.5 KiB each: zero3 issues a gather and a
  reduction per unit per step, so it fills that ring within a few hundred steps, DDP (one
  bucketed all-reduce a step) only at step 2000. ``--fr-buffer N`` passes TORCH_FR_BUFFER_SIZE.
* CPython keeps up to 2000 freed tuples of each small size for reuse; they fill over the
  first thousand steps or so.

At the end each rank also reports its RSS after ``gc.collect()`` and ``malloc_trim``: what
the process holds beyond that is live memory.
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, launch  # noqa: E402

MODES = ["zero3", "zero3_nvme", "ddp"]  # of benchmarks/_peers.py's PEERS


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100, help="steps between RSS samples")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=4, help="blocks, each a zfunc unit")
    p.add_argument("--batch", type=int, default=8, help="rows per rank")
    p.add_argument("--fr-buffer", type=int, default=None, help="TORCH_FR_BUFFER_SIZE (default: torch's)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None, help="also write the samples here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # mode:out_path, set by the launcher
    return p.parse_args()


def _model(args):
    import torch
    from torch import nn

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(args.width, args.width) for _ in range(args.depth))

        def forward(self, x):
            for block in self.blocks:
                x = torch.tanh(block(x))
            return x

    torch.manual_seed(0)
    return Blocks()


def worker(args) -> None:
    """One rank of one mode: train, sample RSS, write the samples as JSON."""
    mode, out = args.worker.split(":", 1)
    os.environ["OMP_NUM_THREADS"] = "1"
    import gc

    import torch

    import zfunc as zf
    from zfunc.testing import memory
    from _peers import Settings, build, init_distributed

    torch.set_num_threads(1)
    init_distributed(mode, "gloo")
    rank = zf.dist.rank()
    model = _model(args)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    swap = tempfile.mkdtemp(prefix=f"zfunc-soak-{rank}-") if mode == "zero3_nvme" else None
    train = build(mode, model, model.blocks, lambda forward, b: ((forward(b[0]) - b[1]) ** 2).mean(),
                  Settings(lr=1e-3, adam="for-loop", nvme_path=swap))  # torch AdamW's default on the CPU

    samples = []
    for i in range(args.steps + 1):
        if i % args.every == 0 or i == args.steps:
            samples.append((i, memory.rss()))
        if i < args.steps:
            train([(x, y)]).item()
    gc.collect()
    zf.buffers.trim()
    result = {"rank": rank, "samples": samples, "after_trim": memory.rss()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    train.close()
    zf.dist.shutdown()


def run_mode(mode: str, args, scratch: str) -> list[dict]:
    out = os.path.join(scratch, mode)
    argv = [os.path.abspath(__file__), "--worker", f"{mode}:{out}", "--steps", str(args.steps),
            "--every", str(args.every), "--width", str(args.width), "--depth", str(args.depth),
            "--batch", str(args.batch)]
    env = {} if args.fr_buffer is None else {"TORCH_FR_BUFFER_SIZE": str(args.fr_buffer)}
    codes = launch(argv, args.world, env=env, timeout=args.timeout)
    if any(codes):
        raise SystemExit(f"soak: mode {mode} failed (exit codes {codes})")
    ranks = []
    for r in range(args.world):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
    return ranks


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def kib(b: float) -> str:
    return f"{b / 2**10:+.0f}"


def report(results: dict, args) -> None:
    modes = list(results)
    steps = [i for i, _ in results[modes[0]][0]["samples"]]
    print(f"RSS per rank (MiB), W={args.world}, {args.depth} blocks of {args.width}, "
          f"TORCH_FR_BUFFER_SIZE={'default' if args.fr_buffer is None else args.fr_buffer}")
    print("step    " + "  ".join(f"{m:>{10 * args.world}}" for m in modes))
    for k, i in enumerate(steps):
        cols = ["".join(f"{mib(rank['samples'][k][1]):>10}" for rank in results[m]) for m in modes]
        print(f"{i:<8}" + "  ".join(cols))
    half = steps[len(steps) // 2]
    first = steps[1] if len(steps) > 2 else steps[0]  # the first sample after step 0 (init, first step)
    print(f"\ngrowth per rank (KiB): steps {first}-{half} | {half}-{steps[-1]}; RSS after gc + malloc_trim (MiB)")
    for m in modes:
        parts = []
        for rank in results[m]:
            s = dict(rank["samples"])
            parts.append(f"rank {rank['rank']}: {kib(s[half] - s[first])} | {kib(s[steps[-1]] - s[half])}; "
                         f"{mib(rank['after_trim'])}")
        print(f"  {m:<11} " + "   ".join(parts))


def main(args):
    with tempfile.TemporaryDirectory(prefix="zfunc-soak-") as scratch:
        results = {m: run_mode(m, args, scratch) for m in args.modes.split(",")}
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
