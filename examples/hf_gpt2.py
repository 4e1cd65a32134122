"""Train a Hugging Face GPT-2 (built from a small config: no download) through zf.initialize.

    python examples/hf_gpt2.py                                          # ZeRO-3, one process
    python examples/hf_gpt2.py --config examples/ds_config_zero3_nvme.json --nvme-path /tmp/swap
    torchrun --standalone --nproc_per_node 2 examples/hf_gpt2.py
    python examples/hf_gpt2.py --save ckpt --steps 30 && python examples/hf_gpt2.py --resume ckpt --steps 30

The script is what a DeepSpeed user already has: a model, a ds_config.json, a data
iterator and `engine.train_batch`. GPT2LMHeadModel computes its own loss from
`labels` (its LM head is tied to the token embedding). Data: bytes of the Python
standard library's source, so nothing is downloaded. Needs `pip install transformers`.
"""
import argparse
import json
import os
import sys

import torch

import zfunc as zf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import get_batch, rank_generator, split, stdlib_corpus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# flags avoid --d.../--n... prefixes of torchrun's own options
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--config", default=os.path.join(HERE, "ds_config_zero3.json"))
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--width", type=int, default=64, help="n_embd")
parser.add_argument("--save", default=None, help="save a checkpoint here at the end")
parser.add_argument("--resume", default=None, help="load the latest checkpoint from here first")
parser.add_argument("--nvme-path", default=None, help="overrides the config's nvme_path (offload to NVMe)")
parser.add_argument("--seed", type=int, default=1234)
parser.add_argument("--mb", type=float, default=1.0, help="MB of stdlib source to train on")


def build_model(layers: int, width: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_positions=seq, n_embd=width, n_layer=layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # tie_word_embeddings: True
    return GPT2LMHeadModel(cfg)


def load_config(path: str, nvme_path: str | None) -> dict:
    with open(path) as f:
        config = json.load(f)
    if nvme_path is not None:
        for key in ("offload_param", "offload_optimizer"):
            section = config.get("zero_optimization", {}).get(key)
            if section and section.get("device") == "nvme":
                section["nvme_path"] = nvme_path
    return config


def batches(data, micro_batch: int, seq: int, seed: int, rank: int):
    """Micro-batches forever: {"input_ids", "labels"} (the model shifts the labels itself)."""
    gen = rank_generator(seed, rank)
    while True:
        x, _ = get_batch(data, micro_batch, seq, gen)
        yield {"input_ids": x, "labels": x}


def main(argv=None):
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = build_model(args.layers, args.width, args.seq)
    engine = zf.initialize(model, load_config(args.config, args.nvme_path))
    rank = zf.dist.rank()
    if args.resume:
        folder, client = engine.load_checkpoint(args.resume)
        if rank == 0:
            print(f"resumed from {folder} at step {engine.global_steps}", file=sys.stderr)
    train_data, _ = split(stdlib_corpus(args.mb))
    data = batches(train_data, engine.train_micro_batch_size_per_gpu(), args.seq, args.seed + engine.global_steps, rank)
    for _ in range(args.steps):
        loss = engine.train_batch(data)
    if rank == 0:
        print(f"step {engine.global_steps}: loss {loss.item():.4f}, {engine.global_samples} samples", file=sys.stderr)
    if args.save:
        engine.save_checkpoint(args.save)
    engine.close()
    zf.dist.shutdown()


if __name__ == "__main__":
    main()
