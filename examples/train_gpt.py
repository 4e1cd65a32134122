"""Train a small GPT on the Python standard library's own source code, with zfunc.

    python examples/train_gpt.py                                   # one process, ZeRO-3
    python examples/train_gpt.py --precision bf16 --accumulate 4   # bf16, 4 micro-batches a step
    python examples/train_gpt.py --offload nvme --swap /tmp/swap   # parameters and Adam state on disk
    python examples/train_gpt.py --compile                         # each block torch.compile'd (inductor)
    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --zero 3

The training step is a pure function (state, batch) -> (state, metrics); the ZeRO
stage is one transform applied to it. Each rank samples its own batch; the step
averages gradients over ranks, so W ranks with --batch B train on W*B sequences a step.
"""
import argparse
import math
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import zfunc as zf
from zfunc.ops import cpu_adam
from gpt import (GPT, GPTConfig, decode, encode, generate, get_batch, num_params, pipeline_layers, rank_generator,
                 split, stdlib_corpus)

# flags avoid --d.../--n... prefixes: torchrun would take them for its own options
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (0: replicated, like DDP)")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--width", type=int, default=128, help="d_model")
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step (all micro-batches)")
parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="compute dtype; bf16/fp16 keep fp32 master weights (fp16: dynamic loss scaling)")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (gradient accumulation)")
parser.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"],
                    help="optimizer state to the CPU, or parameters, gradients and optimizer state to disk")
parser.add_argument("--swap", default=None, help="folder for --offload nvme's swap files (default: a temporary one)")
parser.add_argument("--compile", action="store_true",
                    help="torch.compile each block in place (zf.compile_units); zfunc gathers outside the compiled code")
parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--warmup", type=int, default=20)
parser.add_argument("--mb", type=float, default=4.0, help="MB of stdlib source to train on")
parser.add_argument("--eval-batches", type=int, default=8)
parser.add_argument("--sample", type=int, default=300, help="bytes to generate at the end")
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--pipeline", type=int, default=1,
                    help="pipeline stages (under torchrun with a multiple of this many processes); the rest of the "
                         "ranks are data-parallel replicas of each stage, with --zero 1 or 2 inside them")
args = parser.parse_args()

zf.dist.init()  # under torchrun: a gloo process group from the environment; a no-op otherwise
rank, world = zf.dist.rank(), zf.dist.world_size()
master = rank == 0
torch.manual_seed(args.seed)  # every rank builds the same initial model


def train_pipeline():
    """--pipeline P: the GPT as P stages through zf.initialize, embedding and head tied across
    the first and last stage; each data-parallel replica samples its own micro-batches."""
    train_data, _ = split(stdlib_corpus(args.mb))
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.width, n_layers=args.layers, n_heads=args.heads)

    def lm_loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    pipe = zf.PipelineModule(pipeline_layers(cfg), args.pipeline, lm_loss)
    if args.batch % args.accumulate:
        parser.error(f"--batch {args.batch} does not split into --accumulate {args.accumulate} micro-batches")
    config = {"train_micro_batch_size_per_gpu": args.batch // args.accumulate,
              "gradient_accumulation_steps": args.accumulate, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
              "zero_optimization": {"stage": min(args.zero, 2)}}
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine = zf.initialize(pipe, config)
    gen = rank_generator(args.seed, engine.grid.replica)

    def micro_batches():
        while True:
            yield get_batch(train_data, engine.config.micro_batch_size, args.seq, gen)

    data = micro_batches()
    if master:
        print(f"{args.pipeline} pipeline stages x {engine.grid.replicas} data-parallel replica(s), layer cuts "
              f"{pipe.parts}, {engine.gradient_accumulation_steps()} micro-batches a step ({pipe.schedule})")
    bar = tqdm(range(args.steps), disable=not master, dynamic_ncols=True)
    for _ in bar:
        bar.set_postfix_str(f"loss {engine.train_batch(data).item():.3f}")
    bar.close()
    engine.close()
    zf.dist.shutdown()


if args.pipeline > 1:
    if args.compile:
        parser.error("--compile with --pipeline is not supported yet")
    train_pipeline()
    raise SystemExit(0)

# -----------------------------------------------------------------------------
# data and model

swap_path = args.swap or (tempfile.mkdtemp(prefix="zfunc-swap-") if args.offload == "nvme" else None)
train_data, val_data = split(stdlib_corpus(args.mb))
train_gen = rank_generator(args.seed, rank)
cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.width, n_layers=args.layers, n_heads=args.heads)
model = GPT(cfg)
if args.compile:  # each block one graph; the parameter names stay plain (no _orig_mod.)
    zf.compile_units(model, backend=args.compile_backend)
if master:
    print(f"{num_params(model) / 1e6:.2f}M parameters, {len(train_data) / 1e6:.1f}M training bytes, "
          f"ZeRO-{args.zero}, {args.precision}, {args.accumulate} micro-batch(es), "
          + (f"offload {args.offload}{f' to {swap_path}' if swap_path else ''}, " if args.offload != "none" else "")
          + (f"blocks compiled ({args.compile_backend}), " if args.compile else "")
          + f"on {world} rank(s), "
          f"{world * args.batch} x {args.seq} tokens per step")


def loss_fn(params, batch):
    x, y = batch
    logits = zf.apply(model, params, x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def lr_at(step):  # linear warm-up, then cosine decay to a tenth
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def compose(step):
    """The same transforms for training and evaluation: accumulate inside precision inside ZeRO."""
    if args.accumulate > 1:
        step = zf.accumulate(step, args.accumulate)
    if args.precision != "fp32":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
        step = zf.mixed_precision(step, dtype, loss_scale="dynamic" if args.precision == "fp16" else None)
    if args.offload == "cpu":
        step = zf.offload_cpu(step)
    elif args.offload == "nvme":  # zero1/2 keep whole parameters on every rank: only the rest goes to disk
        step = zf.offload_nvme(step, swap_path, params=args.zero in (0, 3))
    return {0: lambda s: s, 1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[args.zero](step)


if args.batch % args.accumulate:
    parser.error(f"--batch {args.batch} does not split into --accumulate {args.accumulate} micro-batches")
step = compose(zf.train_step(loss_fn, zf.optim.adamw(lr_at, weight_decay=0.01)))
evaluate = compose(zf.eval_step(loss_fn))
state = step.init(model)  # from here on the model is only used through zf.apply


def micro(batch):
    """A batch as the step takes it: split into --accumulate micro-batches when accumulating."""
    if args.accumulate == 1:
        return batch
    return list(zip(*(t.chunk(args.accumulate) for t in batch)))


def val_loss():
    gen = rank_generator(args.seed + 1, rank)  # the same held-out batches each time
    losses = [evaluate(state, micro(get_batch(val_data, args.batch, args.seq, gen)))["loss"]
              for _ in range(args.eval_batches)]
    return torch.stack(losses).mean().item()


# -----------------------------------------------------------------------------
# training

cpu_adam.load()  # the fused Adam is compiled on first use (once, and it says so): before the bar starts
initial_val = val_loss()
tokens_per_step = world * args.batch * args.seq
tok_s = None
bar = tqdm(range(args.steps), disable=not master, dynamic_ncols=True)
for it in bar:
    batch = get_batch(train_data, args.batch, args.seq, train_gen)
    t0 = time.perf_counter()
    state, metrics = step(state, micro(batch))
    loss = metrics["loss"].item()
    dt = time.perf_counter() - t0
    tok_s = tokens_per_step / dt if tok_s is None else 0.9 * tok_s + 0.1 * tokens_per_step / dt
    scale = f", scale {metrics['loss_scale']:g}" if "loss_scale" in metrics else ""
    bar.set_postfix_str(f"loss {loss:.3f}, {tok_s:,.0f} tok/s{scale}")
bar.close()
final_val = val_loss()

params = zf.gather_params(state)  # full fp32 parameters on every rank
if master:
    print(f"val loss {initial_val:.3f} -> {final_val:.3f} after {args.steps} steps")
    prompt = encode("def ")[None]
    with torch.compiler.set_stance("force_eager"):  # --compile: a prompt growing a byte at a time would recompile
        out = generate(lambda x: zf.apply(model, params, x), prompt, args.sample, cfg.seq_len,
                       top_k=40, generator=torch.Generator().manual_seed(args.seed))
    print("-" * 60)
    print(decode(out[0]))
    print("-" * 60)

state.close()  # removes --offload nvme's swap files (a no-op otherwise)
if swap_path and not args.swap:
    shutil.rmtree(swap_path, ignore_errors=True)  # the temporary folder made for them
zf.dist.shutdown()  # gloo may abort at interpreter exit otherwise (torchrun then returns 1)
