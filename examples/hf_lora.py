"""LoRA fine-tuning of a Hugging Face model from a local folder, under ZeRO-3, with peft.

    python examples/hf_lora.py                                  # a small random Llama, written first
    python examples/hf_lora.py --model ./my-llama --targets q_proj v_proj --out ./adapter
    torchrun --standalone --nproc_per_node 2 examples/hf_lora.py

The base model is built on the meta device from the folder's config.json and wrapped by
``peft.get_peft_model``; ``step.init(model, weights=FOLDER)`` reads each base tensor from the
folder's own safetensors files (each rank its part) and initializes the adapters as peft does.
Only the adapters train, and only they hold Adam's state. Every ``--generate-every`` steps the
model generates from a prompt on the state's current weights (``with zf.bind(state, model) as m:
m.generate(...)``: each unit gathered as the forward reaches it). At the end
``zf.checkpoint.save_hf(state, OUT, model=model)`` writes the adapter as
``PeftModel.save_pretrained`` would, and rank 0 loads it back with ``PeftModel.from_pretrained``
over the base folder and checks that its logits and greedy tokens are the trained state's. With
``--merged DIR`` the merged model is written too and loaded back with ``from_pretrained``. Training
data: bytes of the Python standard library's source as token ids (nothing is downloaded). Needs
``pip install transformers peft``.
"""
import argparse
import os
import sys
import tempfile
import time

import torch

import zfunc as zf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import encode, get_batch, rank_generator, split, stdlib_corpus  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="a folder save_pretrained wrote (default: a small random Llama)")
parser.add_argument("--out", default=None, help="where the adapter goes (default: a temporary folder)")
parser.add_argument("--merged", default=None, metavar="DIR", help="also write the merged model to DIR")
parser.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"], help="the modules LoRA adapts")
parser.add_argument("--rank", type=int, default=8, help="LoRA's r")
parser.add_argument("--alpha", type=int, default=16, help="LoRA's alpha")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--generate-every", type=int, default=10, metavar="N", help="generate from the prompt every N steps")
parser.add_argument("--prompt", default="def main(", help="the prompt (its UTF-8 bytes are the token ids)")
parser.add_argument("--new-tokens", type=int, default=16)
parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
parser.add_argument("--seq", type=int, default=64)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--mb", type=float, default=1.0, help="MB of stdlib source to train on")
parser.add_argument("--seed", type=int, default=1234)


def small_llama(folder: str) -> None:
    """A random Llama of 0.2M parameters over a byte vocabulary, written as save_pretrained writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
                                 pad_token_id=0)).save_pretrained(folder)


def generate(state, model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens of ``model`` on ``state``'s current weights (every rank calls it)."""
    with zf.bind(state, model) as m:
        return m.generate(input_ids=prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=False)


def main(args) -> str:
    """Train, generate, save the adapter (and the merged model); returns rank 0's verdict line."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    zf.dist.init()  # under torchrun: a process group from the environment; a no-op otherwise
    rank, world = zf.dist.rank(), zf.dist.world_size()
    scratch = _from_rank0(tempfile.mkdtemp(prefix="zfunc-lora-") if rank == 0 else None)  # one machine
    folder, out = args.model, args.out or os.path.join(scratch, "adapter")
    if folder is None:
        folder = os.path.join(scratch, "small-llama")
        if rank == 0:
            small_llama(folder)
        zf.dist.barrier()

    with torch.device("meta"):  # no weights in memory: step.init reads them unit by unit
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    base.config.use_cache = False
    model = peft.get_peft_model(base, peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                                                      target_modules=args.targets, task_type="CAUSAL_LM"))

    def loss_fn(params, batch):
        x, y = batch
        logits = zf.apply(model, params, input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(args.lr)))
    state = step.init(model, weights=folder)
    report = zf.memory_report(state)
    train_data, _ = split(stdlib_corpus(args.mb))
    gen = rank_generator(args.seed, rank)
    prompt = encode(args.prompt)[None]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{folder}: LoRA r={args.rank} on {args.targets}; {report['param_bytes'] / 1e3:.1f} kB trainable, "
        f"{report['frozen_bytes'] / 1e6:.2f} MB frozen, {report['optimizer_bytes'] / 1e3:.1f} kB of Adam state on "
        f"this rank; {step.composition} on {world} rank(s)", file=sys.stderr)
    for i in range(1, args.steps + 1):
        t0 = time.perf_counter()
        state, metrics = step(state, get_batch(train_data, args.batch, args.seq, gen))
        if i % args.generate_every == 0 or i == args.steps:
            tokens = generate(state, model, prompt, args.new_tokens)
            text = bytes(tokens[0, prompt.shape[1]:].tolist()).decode("utf-8", "replace")
            say(f"step {i}: loss {metrics['loss'].item():.3f}, {time.perf_counter() - t0:.2f} s; "
                f"{args.prompt!r} -> {text!r}", file=sys.stderr)

    zf.checkpoint.save_hf(state, out, model=model)
    if args.merged:
        zf.checkpoint.save_hf(state, args.merged, model=model, merged=True)
    x = get_batch(train_data, 2, args.seq, rank_generator(args.seed, 999))[0]
    with zf.bind(state, model) as m:
        logits = m(input_ids=x).logits
    tokens = generate(state, model, prompt, args.new_tokens)
    state.close()
    verdict = ""
    if rank == 0:
        loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out)
        with torch.no_grad():
            same = torch.equal(loaded(input_ids=x).logits, logits)
            same_tokens = torch.equal(loaded.generate(input_ids=prompt, max_new_tokens=args.new_tokens,
                                                      do_sample=False, use_cache=False), tokens)
        verdict = (f"wrote {out} ({', '.join(sorted(os.listdir(out)))}); PeftModel.from_pretrained loads it: logits "
                   f"{'equal to' if same else 'DIFFERENT from'} the trained state's, greedy tokens "
                   f"{'equal' if same_tokens else 'DIFFERENT'}")
        if args.merged:
            merged, info = AutoModelForCausalLM.from_pretrained(args.merged, output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], info
            close = torch.allclose(merged(input_ids=x).logits, logits, atol=1e-4, rtol=1e-4)
            verdict += (f"; from_pretrained loads the merged model: logits {'equal' if close else 'NOT equal'} to 1e-4 "
                        "(x @ (W + BA) rounds otherwise than x @ W + x @ B A)")
        print(verdict, file=sys.stderr)
    zf.dist.shutdown()
    return verdict


def _from_rank0(text: str | None) -> str:
    """Rank 0's string on every rank (a folder rank 0 chose)."""
    if zf.dist.world_size() == 1:
        return text
    box = [text]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main(parser.parse_args())
