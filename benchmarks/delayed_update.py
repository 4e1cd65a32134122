"""Convergence of the delayed update: ``offload_cpu(delay=1)`` against the exact update, same seeds.

    python benchmarks/delayed_update.py                 # the example GPT and a tiny Llama, 300 steps each
    python benchmarks/delayed_update.py --steps 100 --every 25

Two models, each trained twice under ``zero3(offload_cpu(...))`` in one process on the CPU from the
same initial weights on the same batches (the Python standard library's source as bytes,
examples/gpt.py): exact, and delayed (``delay=1, delay_after=--warmup-exact``). The example GPT
(examples/gpt.py, 0.8M parameters) trains in fp32; a Hugging Face ``LlamaForCausalLM`` built from a
small config (no download) in bf16 under ``mixed_precision``. AdamW with a linear warm-up.
Prints a markdown table: the mean training loss of the steps up to each mark, and the held-out loss
at the end (the same held-out batches for both; for a delayed state, at the parameters its next
forward would use).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import zfunc as zf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import get_batch, split, stdlib_corpus  # noqa: E402
from _curves import models  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--every", type=int, default=50, help="a row every this many steps")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--warmup", type=int, default=20, help="lr warm-up steps")
parser.add_argument("--warmup-exact", type=int, default=0, help="delay_after: exact updates before delaying")
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--models", default="gpt,llama")


def train(args, build, logits_of, dtype, delay: int, train_data, val_data) -> dict:
    torch.manual_seed(args.seed)
    model = build()

    def loss_fn(params, b):
        x, y = b
        return F.cross_entropy(logits_of(model, params, x).flatten(0, 1).float(), y.flatten())

    def lr_at(step):
        return args.lr * min(1.0, (step + 1) / args.warmup)

    def compose(step):
        if dtype is not None:
            step = zf.mixed_precision(step, dtype)
        return zf.zero3(zf.offload_cpu(step, delay=delay, delay_after=args.warmup_exact))

    step = compose(zf.train_step(loss_fn, zf.optim.adamw(lr_at, weight_decay=0.01)))
    evaluate = compose(zf.eval_step(loss_fn))
    state = step.init(model)
    gen = torch.Generator().manual_seed(args.seed)
    losses, delayed, began = [], 0, time.perf_counter()
    for _ in range(args.steps):
        state, m = step(state, get_batch(train_data, args.batch, args.seq, gen))
        losses.append(m["loss"].item())
        delayed += bool(m.get("offload", {}).get("delayed"))
    seconds = time.perf_counter() - began
    held = torch.Generator().manual_seed(args.seed + 1)
    val = sum(evaluate(state, get_batch(val_data, args.batch, args.seq, held))["loss"].item() for _ in range(8)) / 8
    return {"losses": losses, "val": val, "delayed": delayed, "s": seconds}


def main():
    args = parser.parse_args()
    train_data, val_data = split(stdlib_corpus(1.0))
    for name in args.models.split(","):
        build, logits_of, dtype = models(args.seq)[name]
        runs = {d: train(args, build, logits_of, dtype, d, train_data, val_data) for d in (0, 1)}
        n = sum(p.numel() for p in build().parameters())
        print(f"\n{name}: {n / 1e6:.2f}M parameters, {'bf16' if dtype else 'fp32'}, {args.batch}x{args.seq} tokens a "
              f"step, delayed updates: {runs[1]['delayed']} of {args.steps}, "
              f"{runs[0]['s']:.0f} s exact / {runs[1]['s']:.0f} s delayed\n")
        print("| steps | exact | delay=1 | delay=1 - exact |\n|---|---|---|---|")
        marks = sorted(set(range(args.every, args.steps + 1, args.every)) | {args.steps})
        lo = 0
        for hi in marks:
            a, b = (sum(runs[d]["losses"][lo:hi]) / (hi - lo) for d in (0, 1))
            print(f"| {lo + 1}-{hi} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
            lo = hi
        a, b = runs[0]["val"], runs[1]["val"]
        print(f"| held out, after {args.steps} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")


if __name__ == "__main__":
    main()
