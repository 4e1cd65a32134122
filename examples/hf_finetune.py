"""Fine-tune a Hugging Face model from a local folder with zfunc, and write it back as one.

    python examples/hf_finetune.py                                   # a small random Llama, written first
    python examples/hf_finetune.py --model ./my-llama --zero3 --offload-cpu --out ./tuned
    python examples/hf_finetune.py --zero3 --offload-nvme /tmp/swap   # parameters and Adam state on disk
    torchrun --standalone --nproc_per_node 2 examples/hf_finetune.py --zero3

The model is built on the meta device from the folder's config.json, so it holds no weights;
``step.init(model, weights=FOLDER)`` fills each unit from the folder's safetensors files, each
rank reading only its own part, so no rank ever holds the whole model. After fine-tuning on
bytes of the Python standard library's source (as token ids: nothing is downloaded),
``zf.checkpoint.save_hf`` writes the folder ``save_pretrained`` would, one unit in memory at a
time, and rank 0 loads it back with ``from_pretrained`` to check. With no ``--model`` a small
random Llama is written first with ``save_pretrained``. Needs ``pip install transformers``.
"""
import argparse
import os
import sys
import tempfile
import time

import torch
from tqdm import tqdm

import zfunc as zf
from zfunc.ops import cpu_adam

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import get_batch, rank_generator, split, stdlib_corpus  # noqa: E402

# flags avoid --d.../--n... prefixes of torchrun's own options
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="a folder save_pretrained wrote (default: a small random Llama)")
parser.add_argument("--out", default=None, help="where the fine-tuned model goes (default: a temporary folder)")
parser.add_argument("--zero3", action="store_true", help="shard parameters, gradients and optimizer state (else "
                                                         "replicated, like DDP)")
parser.add_argument("--offload-cpu", action="store_true", help="Adam state and master weights in CPU memory")
parser.add_argument("--offload-nvme", default=None, metavar="PATH",
                    help="parameters, gradients and Adam state in swap files under PATH")
parser.add_argument("--bf16", action="store_true", help="compute in bf16, fp32 master weights")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--max-shard-size", default="5GB", help="of the exported safetensors files")
parser.add_argument("--mb", type=float, default=1.0, help="MB of stdlib source to train on")
parser.add_argument("--seed", type=int, default=1234)


def small_llama(folder: str) -> None:
    """A random Llama of 0.2M parameters, written as save_pretrained writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(folder)


def compose(step, args):
    if args.bf16:  # RoPE's frequencies stay fp32, as Hugging Face reads them
        step = zf.mixed_precision(step, torch.bfloat16, keep=lambda n: n.endswith("inv_freq"))
    if args.offload_cpu:
        step = zf.offload_cpu(step)
    elif args.offload_nvme:
        step = zf.offload_nvme(step, args.offload_nvme)
    return zf.zero3(step) if args.zero3 else step


def main(args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.offload_cpu and args.offload_nvme:
        parser.error("--offload-cpu and --offload-nvme: choose one")
    zf.dist.init()  # under torchrun: a process group from the environment; a no-op otherwise
    rank, world = zf.dist.rank(), zf.dist.world_size()
    scratch = _from_rank0(tempfile.mkdtemp(prefix="zfunc-hf-") if rank == 0 else None)  # one machine
    folder, out = args.model, args.out or os.path.join(scratch, "tuned")
    if folder is None:
        folder = os.path.join(scratch, "small-llama")
        if rank == 0:
            small_llama(folder)
        zf.dist.barrier()

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # no weights in memory: step.init reads them unit by unit
        model = AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    n = sum(p.numel() for p in model.parameters())

    def loss_fn(params, batch):
        x, y = batch
        logits = zf.apply(model, params, input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    step = compose(zf.train_step(loss_fn, zf.optim.adamw(args.lr, weight_decay=0.01)), args)
    state = step.init(model, weights=folder)
    train_data, _ = split(stdlib_corpus(args.mb))
    gen = rank_generator(args.seed, rank)
    if rank == 0:
        print(f"{folder}: {type(model).__name__}, {n / 1e6:.2f}M parameters; {step.composition} on {world} "
              "rank(s)", file=sys.stderr)
    cpu_adam.load()  # the fused Adam is compiled on first use (once, and it says so): before the bar starts
    bar = tqdm(range(args.steps), disable=rank != 0, dynamic_ncols=True)
    first = None
    for _ in bar:
        t0 = time.perf_counter()
        state, metrics = step(state, get_batch(train_data, args.batch, args.seq, gen))
        loss = metrics["loss"].item()
        first = loss if first is None else first
        bar.set_postfix_str(f"loss {loss:.3f}, {time.perf_counter() - t0:.2f} s/step")
    bar.close()

    zf.checkpoint.save_hf(state, out, max_shard_size=args.max_shard_size, config=folder)
    params = zf.gather_params(state)
    state.close()  # removes --offload-nvme's swap files
    if rank == 0:
        tuned, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        dtype = next(tuned.parameters()).dtype
        same = all(torch.equal(t, params[k].to(dtype)) for k, t in tuned.state_dict().items() if k in params)
        print(f"loss {first:.3f} -> {loss:.3f}; wrote {out} ({', '.join(sorted(os.listdir(out)))}); "
              f"from_pretrained loads it, {'equal to' if same else 'DIFFERENT from'} the trained weights",
              file=sys.stderr)
    zf.dist.shutdown()


def _from_rank0(text: str | None) -> str:
    """Rank 0's string on every rank (a folder rank 0 chose)."""
    if zf.dist.world_size() == 1:
        return text
    box = [text]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main(parser.parse_args())
