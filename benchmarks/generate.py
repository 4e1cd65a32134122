"""Generation during training: ``zf.bind`` against gathering the whole model, peak memory and time.

    python benchmarks/generate.py                    # a 31.6M-parameter Llama, W = 2 gloo ranks, ZeRO-3
    python benchmarks/generate.py --small            # smoke test

Each rank holds a ``zero3(train_step(adamw))`` state (one step taken) of a Llama built on the
meta device. Then, each way in fresh processes, every rank generates ``--new`` tokens greedily
from the same prompt:

* ``bind``: ``with zf.bind(state, model) as m: m.generate(...)``: each unit gathered as the
  forward reaches it and released after;
* ``gather``: what a user does without it: ``zf.gather_params(state)``, a model of the same
  config built on the CPU, ``load_state_dict``, ``generate``.

The peak RSS the generation adds above the rank's RSS before it (VmHWM, reset just before) is
the largest over the ranks, beside the process's peak over its whole run (init, the training
step and the generation: a phase's added peak can be small where it reuses memory the step's
gathers left in the allocator); the time is the slowest rank's. Both ways must give the same tokens.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _launch import driver_or_worker, each_in_fresh_processes  # noqa: E402
from _llama import llama  # noqa: E402
from _worker import measured  # noqa: E402

import zfunc as zf  # noqa: E402
from zfunc.testing import memory  # noqa: E402

WAYS = ("bind", "gather")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new", type=int, default=16, help="tokens generated")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--small", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.new = 2, 128, 256, 4
    return args


def lm_loss(params, batch):
    return zf.apply(MODEL, params, input_ids=batch, labels=batch).loss


MODEL = None


def worker(args) -> None:
    """One way (``--worker WAY,OUT``) on this rank: the generation's peak RSS, seconds and tokens."""
    global MODEL
    way, out = args.worker.split(",")
    torch.set_num_threads(1)
    zf.dist.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    MODEL = llama(args, "meta")
    step = zf.zero3(zf.train_step(lm_loss, zf.optim.adamw(1e-3)))
    state = step.init(MODEL)
    g = torch.Generator().manual_seed(1 + rank)
    state, _ = step(state, torch.randint(0, args.vocab, (1, 32), generator=g))
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    greedy = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0)
    if way == "bind":
        def generate():
            with zf.bind(state, MODEL) as m:
                return m.generate(prompt, **greedy)
    else:
        def generate():
            full = zf.gather_params(state)
            plain = llama(args, "cpu")
            plain.load_state_dict(full, strict=False)  # rotary inv_freq is computed, not stored
            return plain.generate(prompt, **greedy)
    before, trained_peak = memory.rss(), memory.peak()  # the peak of init and the step, since the start
    with torch.no_grad():
        tokens, seconds, peak = measured(generate)
    stats = torch.tensor([peak, seconds, max(trained_peak, before + peak)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in MODEL.parameters())
        with open(out, "w") as f:
            json.dump({"peak": stats[0].item(), "seconds": stats[1].item(), "process": stats[2].item(),
                       "tokens": tokens.tolist(),
                       "params": params}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(args):
    argv = ["--layers", str(args.layers), "--width", str(args.width), "--vocab", str(args.vocab), "--prompt",
            str(args.prompt), "--new", str(args.new)]
    rows = each_in_fresh_processes(args.ways.split(","), __file__, argv, args.world, env={"OMP_NUM_THREADS": "1"},
                                   timeout=args.timeout)
    params = next(iter(rows.values()))["params"]
    print(f"Llama, {params / 1e6:.1f}M parameters ({4 * params / 2**20:.0f} MiB in fp32), {args.layers} layers, "
          f"zero3, W = {args.world}; {args.new} tokens generated greedily from {args.prompt}; the largest rank's "
          "peak RSS above its RSS before, the slowest rank's time")
    print("| way | peak RSS added (MiB) | x fp32 model size | the process's peak RSS (MiB) | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for way, r in rows.items():
        print(f"| {way} | {r['peak'] / 2**20:.1f} | {r['peak'] / (4 * params):.2f} | {r['process'] / 2**20:.0f} | "
              f"{r['seconds']:.2f} |")
    if len(rows) > 1:
        same = len({json.dumps(r["tokens"]) for r in rows.values()}) == 1
        print("same tokens: " + ("yes" if same else "NO: the ways generated different tokens"))


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
