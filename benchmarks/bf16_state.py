"""Adam's moments in bf16 (``adamw(state_dtype=torch.bfloat16)``) against fp32 moments: the loss
curve, the host bytes a parameter and the CPU Adam update's time.

    python benchmarks/bf16_state.py                       # both models, 300 steps each, then the timing
    python benchmarks/bf16_state.py --steps 100 --every 25 --models gpt --size 5M

Loss: two models, each trained twice under ``zero3(offload_cpu(...))`` in one process on the CPU from
the same initial weights on the same batches (the Python standard library's source as bytes,
examples/gpt.py), with fp32 and with bf16 moments. The example GPT (examples/gpt.py) trains in fp32;
a Hugging Face ``LlamaForCausalLM`` built from a small config (no download) in bf16 under
``mixed_precision`` (fp32 master weights). AdamW with a linear warm-up. Prints a markdown table: the
mean training loss of the steps up to each mark, and the held-out loss at the end (the same held-out
batches for both), then each run's optimizer state bytes a parameter (memory_report: moments, and
the fp32 master weights under mixed precision).

Timing: ``zfunc.ops.adam.adam_update_`` (the fused CPU kernel where built) on one flat tensor of
``--size`` elements, fp32 parameters and gradients, fp32 or bf16 moments; medians over ``--reps``,
the two alternating. Bytes counted an element (reads + writes): fp32 moments 28 (p, g, m, v read;
p, m, v written), bf16 moments 20.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import zfunc as zf
from zfunc.ops import adam, cpu_adam

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _sizes import parse_size  # noqa: E402
from gpt import get_batch, split, stdlib_corpus  # noqa: E402
from _curves import models  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BYTES = {"fp32": 28, "bf16": 20}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--every", type=int, default=50, help="a row every this many steps")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--warmup", type=int, default=20, help="lr warm-up steps")
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--models", default="gpt,llama", help="comma-separated; empty: timing only")
parser.add_argument("--size", type=parse_size, default=parse_size("20M"), help="elements the timed update covers")
parser.add_argument("--reps", type=int, default=9)


def train(args, build, logits_of, dtype, state_dtype, train_data, val_data) -> dict:
    torch.manual_seed(args.seed)
    model = build()

    def loss_fn(params, b):
        x, y = b
        return F.cross_entropy(logits_of(model, params, x).flatten(0, 1).float(), y.flatten())

    def compose(step):
        if dtype is not None:
            step = zf.mixed_precision(step, dtype)
        return zf.zero3(zf.offload_cpu(step))

    opt = zf.optim.adamw(lambda s: args.lr * min(1.0, (s + 1) / args.warmup), weight_decay=0.01,
                         state_dtype=state_dtype)
    step, evaluate = compose(zf.train_step(loss_fn, opt)), compose(zf.eval_step(loss_fn))
    state = step.init(model)
    gen = torch.Generator().manual_seed(args.seed)
    losses, began = [], time.perf_counter()
    for _ in range(args.steps):
        state, m = step(state, get_batch(train_data, args.batch, args.seq, gen))
        losses.append(m["loss"].item())
    seconds = time.perf_counter() - began
    held = torch.Generator().manual_seed(args.seed + 1)
    val = sum(evaluate(state, get_batch(val_data, args.batch, args.seq, held))["loss"].item() for _ in range(8)) / 8
    numel = sum(t.numel() for t in state.params.leaves)
    per_param = zf.memory_report(state)["optimizer_bytes"] / numel
    return {"losses": losses, "val": val, "s": seconds, "per_param": per_param}


def curves(args) -> None:
    train_data, val_data = split(stdlib_corpus(1.0))
    for name in [n for n in args.models.split(",") if n]:
        build, logits_of, dtype = models(args.seq)[name]
        runs = {k: train(args, build, logits_of, dtype, d, train_data, val_data) for k, d in DTYPES.items()}
        n = sum(p.numel() for p in build().parameters())
        print(f"\n{name}: {n / 1e6:.2f}M parameters, {'bf16 compute, fp32 masters' if dtype else 'fp32'}, "
              f"{args.batch}x{args.seq} tokens a step, {runs['fp32']['s']:.0f} s fp32 moments / "
              f"{runs['bf16']['s']:.0f} s bf16 moments; optimizer state a parameter: "
              f"{runs['fp32']['per_param']:.2f} B / {runs['bf16']['per_param']:.2f} B\n")
        print("| steps | fp32 moments | bf16 moments | bf16 - fp32 |\n|---|---|---|---|")
        lo = 0
        for hi in sorted(set(range(args.every, args.steps + 1, args.every)) | {args.steps}):
            a, b = (sum(runs[k]["losses"][lo:hi]) / (hi - lo) for k in DTYPES)
            print(f"| {lo + 1}-{hi} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
            lo = hi
        a, b = runs["fp32"]["val"], runs["bf16"]["val"]
        print(f"| held out, after {args.steps} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")


def timing(args) -> None:
    n = args.size
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    states = {k: (torch.zeros(n, dtype=d), torch.zeros(n, dtype=d)) for k, d in DTYPES.items()}
    times = {k: [] for k in DTYPES}
    for rep in range(args.reps + 1):
        for k in (list(DTYPES) if rep % 2 else list(DTYPES)[::-1]):
            m, v = states[k]
            began = time.perf_counter()
            adam.adam_update_([p], [g], [m], [v], step=rep + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01, decoupled=True)
            if rep:  # the first round warms the pages and the threads
                times[k].append(time.perf_counter() - began)
    kernel = cpu_adam.load().simd() if cpu_adam.available() else "not built: torch's fused AdamW"
    print(f"\nCPU Adam on {n / 1e6:.0f}M elements, fp32 params and grads, {torch.get_num_threads()} threads, "
          f"kernel: {kernel}, median of {args.reps}\n")
    print("| moments | state bytes a parameter | bytes moved a parameter | ms | GB/s counted |\n|---|---|---|---|---|")
    for k, d in DTYPES.items():
        t = statistics.median(times[k])
        print(f"| {k} | {2 * d.itemsize} | {BYTES[k]} | {t * 1e3:.1f} | {BYTES[k] * n / t / 1e9:.2f} |")


def main():
    args = parser.parse_args()
    curves(args)
    timing(args)


if __name__ == "__main__":
    main()
