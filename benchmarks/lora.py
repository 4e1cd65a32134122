"""LoRA fine-tuning of a Hugging Face Llama: one DeepSpeed-style script under zfunc.deepspeed and
under DeepSpeed ZeRO-3, and FSDP2, in the same run.

    python benchmarks/lora.py                 # a 31.6M-parameter Llama, W = 2 gloo ranks
    python benchmarks/lora.py --small         # smoke test

Each peer runs in fresh processes on the same model (seed 0), the same LoRA adapters (peft,
r = 8 on the attention's q/k/v/o projections, seed 1) and the same batches:

* ``zfunc``: the DeepSpeed script's loop (``engine, *_ = deepspeed.initialize(model=,
  model_parameters=, config=)``, ``engine(input_ids=, labels=)``, ``backward``, ``step``) with
  ``import zfunc.deepspeed as deepspeed``;
* ``deepspeed``: the same loop under DeepSpeed 0.19.8, ZeRO-3, torch AdamW (CPU accelerator);
* ``fsdp2``: ``fully_shard`` on each decoder layer and the root (torchtitan's way), torch AdamW
  over the adapters.

Reported: the median step (the slowest rank's, after warm-up), the largest rank's peak RSS
above its RSS before building the model, and the loss at each step (rank 0's).
"""
import argparse
import importlib
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

from zfunc.testing import memory  # noqa: E402

PEERS = ("zfunc", "deepspeed", "fsdp2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rank_r", type=int, default=8, help="LoRA rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--small", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.layers, args.width, args.vocab, args.seq, args.steps, args.warmup = 2, 128, 256, 32, 3, 1
    return args


def lora_model(args):
    import peft

    torch.manual_seed(0)
    model = llama(args, "cpu")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=args.rank_r, lora_alpha=2 * args.rank_r, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, config)


def ds_config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}


def deepspeed_script(module_name: str, model, args):
    """``train(ids) -> loss``: the DeepSpeed script's loop, ``deepspeed`` being ``module_name``."""
    deepspeed = importlib.import_module(module_name)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(args))

    def train(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return train


def fsdp2_train(model, args):
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)

    def train(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return train


def worker(args) -> None:
    """Peer ``--worker PEER,OUT`` on this rank."""
    peer, out = args.worker.split(",")
    torch.set_num_threads(1)
    if peer == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    before = memory.rss()
    memory.reset_peak()
    model = lora_model(args)
    if peer == "fsdp2":
        train = fsdp2_train(model, args)
    else:
        train = deepspeed_script("zfunc.deepspeed" if peer == "zfunc" else "deepspeed", model, args)
    g = torch.Generator().manual_seed(10 + rank)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(train(ids).item())
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(seconds.item())
    peak = torch.tensor([memory.peak() - before], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        with open(out, "w") as f:
            json.dump({"times": times, "losses": losses, "peak": peak.item(), "trainable": trainable}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(args):
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    rows = each_in_fresh_processes(args.peers.split(","), __file__, sys.argv[1:], args.world, env=env,
                                   timeout=args.timeout)
    first = next(iter(rows.values()))
    print(f"LoRA r = {args.rank_r} on q/k/v/o of a Llama ({args.layers} layers, width {args.width}, vocab "
          f"{args.vocab}; {first['trainable'] / 1e3:.0f}K trainable parameters), W = {args.world}, "
          f"{args.batch} x {args.seq} tokens a rank a step, fp32; median of {args.steps} steps after {args.warmup}")
    base = statistics.median(rows["zfunc"]["times"]) if "zfunc" in rows else None
    print("| peer | step (s) | x zfunc | peak RSS added (MiB) |")
    print("| --- | --- | --- | --- |")
    for peer, r in rows.items():
        t = statistics.median(r["times"])
        ratio = f"{t / base:.2f}" if base else "-"
        print(f"| {peer} | {t:.3f} | {ratio} | {r['peak'] / 2**20:.0f} |")
    print("| step | " + " | ".join(rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for i in range(len(first["losses"])):
        print(f"| {i + 1} | " + " | ".join(f"{r['losses'][i]:.6f}" for r in rows.values()) + " |")


if __name__ == "__main__":
    driver_or_worker(parse_args, main, worker)
