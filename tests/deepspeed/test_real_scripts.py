"""Real DeepSpeed training scripts, unchanged but for their data made local (each file's header
says what changed), run under real DeepSpeed (CPU accelerator, gloo) and under zfunc with the
switch on (``ZFUNC_AS_DEEPSPEED=1``: their own ``import deepspeed`` imports zfunc.deepspeed), by
torchrun at W = 1 and 2: every rank's per-step losses compared (and what rank 0 prints).

DeepSpeed-Chat's step 1 (supervised fine-tuning of a causal LM: the script's own ``FusedAdam``
over its no-decay groups, transformers' cosine schedule, ``get_accelerator``, ``init_distributed``,
its evaluation and throughput lines) trains only in bf16 or fp16 (its ``--dtype``); on the CPU,
bf16. The first two steps' losses are equal to the bit (same weights, the first update at lr 0
warming up); after that DeepSpeed's bf16 optimizer and zfunc's round the updated weights to
bf16 differently in a few elements, so the losses agree to bf16's rounding (relative 1e-3, seen
~2e-4), not to fp32's 1e-5.

Not run: ZeRO-3 (transformers' ``resize_token_embeddings`` under ZeRO-3 hands
``GatheredParameters`` the lm head's missing bias, ``None``, which DeepSpeed skips and
zfunc.deepspeed.zero refuses), ``--offload`` (the script's config names ``offload_param`` at every
stage, which DeepSpeed ignores below ZeRO-3 and zfunc's parser refuses), and ZeRO-0 (DeepSpeed's
bf16 without ZeRO takes its fp16 optimizer's path, whose losses differ from its own ZeRO stages' by
~1e-3; zfunc's equal its ZeRO-1/2 ones).

All in the slow tier: each case is two launches of W processes importing transformers and
DeepSpeed or zfunc (30-70 s each here).
"""
import math
import os
import re

import pytest
import torch

from ds_scripts import SCRIPTS, launch, tiny_opt

CHAT = os.path.join(SCRIPTS, "deepspeed_chat")
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]\d+)?")


def chat_args(folder, model: str, stage: int) -> list[str]:
    return ["--data_path", "local/random", "--data_split", "6,2,2", "--data_output_path", os.path.join(folder, "data"),
            "--model_name_or_path", model, "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--max_seq_len", "16", "--learning_rate", "1e-3", "--weight_decay", "0.1", "--num_warmup_steps", "2",
            "--zero_stage", str(stage), "--dtype", "bf16", "--dropout", "0.0", "--print_loss"]


def evaluations(lines: list[str]) -> list[tuple[float, float]]:
    """DeepSpeed-Chat's ``ppl: P, loss: L`` lines (before and after the epoch)."""
    return [tuple(float(x) for x in NUMBER.findall(line)) for line in lines if line.startswith("ppl:")]


@pytest.mark.slow
@pytest.mark.parametrize("world, stage", [(1, 2), (2, 2), (2, 1)], ids=["W1-zero2", "W2-zero2", "W2-zero1"])
def test_deepspeed_chat_step1_sft_matches_deepspeed(world, stage, tmp_path):
    model = tiny_opt(tmp_path / "tiny_opt")
    script = os.path.join(CHAT, "main.py")
    runs = {}
    for zfunc in (False, True):
        folder = str(tmp_path / ("zfunc" if zfunc else "deepspeed"))
        runs[zfunc] = launch(script, chat_args(folder, model, stage), world, folder, zfunc=zfunc, pythonpath=CHAT)
    (theirs_out, theirs), (ours_out, ours) = runs[False], runs[True]
    for rank in range(world):
        assert len(ours[rank]) == len(theirs[rank]) == math.ceil(math.ceil(58 / world) / 2), rank  # 58 samples, padded
        assert ours[rank][:2] == theirs[rank][:2]  # bit for bit before the first bf16 rounding of an update
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=1e-3, atol=0)
    ev, tv = evaluations(ours_out), evaluations(theirs_out)
    assert len(ev) == len(tv) == 2
    assert ev[0] == tv[0]  # the evaluation before training: the same weights
    torch.testing.assert_close(torch.tensor(ev[1]), torch.tensor(tv[1]), rtol=2e-3, atol=0)
    assert sum("Model Parameters:" in line for line in ours_out) == len(ours[0])  # print_throughput ran each step
