"""Reinforcement learning with a GRPO-style objective: a small policy from a Hugging Face config
learns to continue a digit with its successor, on the CPU in about a minute.

    python examples/rl_grpo.py
    torchrun --standalone --nproc_per_node 2 examples/rl_grpo.py

Each iteration is the loop RL post-training runs (verl, OpenRLHF, TRL), with a plain Hugging
Face model standing in for the inference engine (vLLM, SGLang):

1. **Refresh the engine**: the trainer's current weights stream into the rollout model unit by
   unit (``zf.iter_weights``: one unit gathered at a time, handed out in buckets, as an engine's
   ``load_weights`` takes them); no file, no whole-model gather.
2. **Roll out**, the trainer's state off the device meanwhile (``zf.offload_states``, back with
   ``zf.reload_states``; ``--offload nvme`` to a file, ``cpu`` to host memory, a no-op on a
   CPU-only machine): the rollout model samples ``--group`` completions of ``--length`` tokens for each
   of ``--prompts`` prompts (a start token and a digit d); a completion's reward is the share of
   its tokens equal to (d + 1) mod 8.
3. **Train**: advantages are the rewards normalized within each prompt's group (GRPO's baseline,
   no critic); one ``zero3(train_step(...))`` update on ``-advantage x log-probability`` of the
   completion's tokens (on-policy, so the clipped ratio is 1 and drops out).

Each rank rolls out its own prompts and the update averages over ranks. The mean reward starts
near 1/8 (chance) and rises; the last line says from what to what.
"""
import argparse
import shutil
import tempfile
import time

import torch
import transformers
from tqdm import tqdm

import zfunc as zf

DIGITS, START = 8, 8  # tokens 0..7 are digits, 8 starts a prompt

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--iterations", type=int, default=100)
parser.add_argument("--prompts", type=int, default=8, help="prompts a rank rolls out per iteration")
parser.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's group)")
parser.add_argument("--length", type=int, default=6, help="tokens per completion")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--bucket-mb", type=float, default=1.0, help="size of the weight stream's buckets")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--offload", default="cpu", choices=["cpu", "nvme", "none"],
                    help="where the trainer's state waits while rollouts run")

transformers.logging.set_verbosity_error()  # generate's notes on pad tokens


def main(args) -> tuple[float, float]:
    """The RL loop; returns the mean reward over the first and the last five iterations."""
    zf.dist.init()
    rank, world = zf.dist.rank(), zf.dist.world_size()
    master = rank == 0
    config = transformers.GPT2Config(vocab_size=DIGITS + 1, n_positions=16, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=START, eos_token_id=START, pad_token_id=START)

    # the policy: built on the meta device, materialized unit by unit (transformers' own init)
    with torch.device("meta"):
        policy = transformers.GPT2LMHeadModel(config)
    # the inference engine's model: a plain copy the trainer's weights are streamed into
    rollout = transformers.GPT2LMHeadModel(config).eval()
    rollout_tensors = rollout.state_dict()


    def grpo_loss(params, batch):
        """``-advantage x log-probability`` of each completion token, averaged."""
        ids, advantages = batch
        logits = zf.apply(policy, params, input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, 1:]  # the completion's
        return -(advantages[:, None] * logp).mean()


    def refresh(state) -> None:
        """The rollout model takes the trainer's current weights, unit by unit."""
        with torch.no_grad():
            for name, t in zf.iter_weights(state, bucket_bytes=int(args.bucket_mb * 2**20)):
                rollout_tensors[name].copy_(t)


    def roll_out(generator: torch.Generator):
        """``(prompt + completion token ids, rewards)`` of ``prompts x group`` sampled completions."""
        digits = torch.randint(0, DIGITS, (args.prompts,), generator=generator)
        prompts = torch.stack([torch.full_like(digits, START), digits], 1).repeat_interleave(args.group, 0)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        with torch.no_grad():
            ids = rollout.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                                   max_new_tokens=args.length, min_new_tokens=args.length, pad_token_id=START)
        target = (prompts[:, 1:] + 1) % DIGITS
        rewards = (ids[:, 2:] == target).float().mean(1)
        return ids, rewards


    def advantages(rewards: torch.Tensor) -> torch.Tensor:
        groups = rewards.view(args.prompts, args.group)
        return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()


    def mean_over_ranks(value: torch.Tensor) -> float:
        value = value.detach().clone().reshape(1)
        zf.dist.all_reduce_sum(value)
        return value.item() / world


    torch.manual_seed(args.seed)
    step = zf.zero3(zf.train_step(grpo_loss, zf.optim.adamw(args.lr, weight_decay=0.0)))
    state = step.init(policy)
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    rewards_seen, start = [], time.perf_counter()
    bar = tqdm(range(args.iterations), disable=not master, dynamic_ncols=True)
    offload_dir = tempfile.mkdtemp(prefix="rl_grpo-") if args.offload == "nvme" else None
    for it in bar:
        refresh(state)
        if args.offload != "none":
            state = zf.offload_states(state, device=args.offload, path=offload_dir)
        ids, rewards = roll_out(generator)
        if args.offload != "none":
            state = zf.reload_states(state)
        state, metrics = step(state, (ids, advantages(rewards)))
        rewards_seen.append(mean_over_ranks(rewards.mean()))
        bar.set_description(f"reward {rewards_seen[-1]:.3f} loss {float(metrics['loss']):+.4f}")

    if offload_dir is not None:
        shutil.rmtree(offload_dir)
    first, last = sum(rewards_seen[:5]) / 5, sum(rewards_seen[-5:]) / 5
    if master:
        print(f"mean reward {first:.3f} -> {last:.3f} over {args.iterations} iterations "
              f"({time.perf_counter() - start:.0f} s, W = {world})", flush=True)
    return first, last


if __name__ == "__main__":
    main(parser.parse_args())
