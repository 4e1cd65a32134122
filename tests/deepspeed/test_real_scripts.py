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

DeepSpeedExamples' pipeline-parallelism script (AlexNet, the config's Adam, ``RepeatingLoader``,
``deepspeed.runtime.utils.set_random_seed``): with ``-p 2`` a two-stage ``PipelineModule`` trained
by ``engine.train_batch()`` from the engine's own loader of ``training_data``; with ``-p 0`` the
plain data-parallel loop. fp32: the losses equal to 1e-5 over two epochs (dropout included). Its
config is the example's with a batch of 16 (micro-batches of 4), lr 1e-4 (at the example's 1e-3
a loss spike at step 2 makes the run chaotic: 1e-7 apart after one update, 1e-3 after four) and
gradient clipping off: DeepSpeed's pipeline engine counts only the first stage's gradients in the
norm it clips by (``clip_grad_norm_`` keeps model-parallel rank 0's, and the pipeline's stages are
its model-parallel group), where zfunc clips by the whole model's norm, as torch does.

DeepSpeedExamples' CIFAR-10 script (``training/cifar``: ``init_distributed``,
``get_accelerator().set_device``, its config's Adam, WarmupLR, clipping and ZeRO stage, the
engine's loader of ``training_data``, ``deepspeed.moe.utils`` imported, an evaluation with
``engine.eval()``), fp32: the losses equal to 1e-5 and the same accuracy lines. It never seeds, so
ds_launch.py seeds torch first for both runs.

DeepSpeed-Chat at ZeRO-3 loads the model with ``from_pretrained`` under its ``HfDeepSpeedConfig``
(zfunc.deepspeed.zero's spill: the parameters left as DeepSpeed leaves partitioned ones, 0 elements
on the real device with ``ds_shape``) and then calls ``resize_token_embeddings``, which builds a new
embedding and lm head "like" the old weights (their device and dtype), copies the old rows in under
``GatheredParameters`` (the lm head's absent bias, ``None``, in the list) and puts them in the old
ones' places: the same losses as DeepSpeed's, to the same bound.

DeepSpeed-Chat, not run: ``--offload`` (the script's config names ``offload_param`` at every
stage, which DeepSpeed ignores below ZeRO-3 and zfunc's parser refuses), and ZeRO-0 (DeepSpeed's
bf16 without ZeRO takes its fp16 optimizer's path, whose losses differ from its own ZeRO stages' by
~1e-3; zfunc's equal its ZeRO-1/2 ones).

DeepSpeed-Chat's step 2 (reward model fine-tuning: ``create_critic_model`` wraps the loaded
transformer with a value head, ``DataCollatorReward``, its reward evaluation, ``save_hf_format``
on rank 0 and ``save_zero_three_model``'s ``GatheredParameters`` per parameter), with
``--compute_fp32_loss``: at ZeRO-1 and 2 its losses are DeepSpeed's, the first two to the bit, then
to bf16's rounding of the updates (seen ~7e-3 relative after ten: the reward model is tiny and the
loss a difference of two scores); the evaluation before training equal, after it to the same bound,
and the saved critic has DeepSpeed's keys, shapes and dtypes, its values apart by at most what
Adam's steps can move them (lr per step). At ZeRO-3 DeepSpeed 0.19.8 fails on this script at
``initialize`` (its defragment asserts one dtype, and the value head, built outside ``zero.Init``,
stays fp32); zfunc trains it from the model DeepSpeed builds (the same generator draws: DeepSpeed's
``zero.Init`` loading path draws none), and the critic it saves holds every weight in full.

DeepSpeed-Chat's step 2 by DPO (``step2_dpo_finetuning``: the policy trained against a frozen
reference model that is a second, forward-only ``deepspeed.initialize`` with no optimizer, ZeRO-0 or
ZeRO-3 as the script picks, its loss computed in bf16): at ZeRO-2 and ZeRO-3 the first two losses
are DeepSpeed's to the bit and the rest within two bf16 units in the last place (seen: one), the
evaluation before training equal and the one after it within that bound, and the saved model as
the reward model's above (at ZeRO-3 in fp32 where DeepSpeed's is bf16: ``save_zero_three_model``
saves what ``GatheredParameters`` shows, zfunc's fp32 master weights).

DeepSpeed-Chat's step 3 (RLHF by PPO: ``DeepSpeedRLHFEngine``'s four engines, the actor and the
critic trained, the reference and reward models forward-only; ``actor.module.generate`` with
``synced_gpus`` at ZeRO-3; the critic's ``forward_value`` called on its engine, which DeepSpeed's
engine hands to its module), from a critic that step 2 saved on zfunc, at W = 2: every actor and
critic loss of the first three PPO steps equal to DeepSpeed's to the bit, the rest within a bf16
unit of the largest loss (2^-8; seen 2e-3), and every printed reward score equal (the same answers
generated). Actor at ZeRO-2 and 3 against DeepSpeed at the same stages; both at ZeRO-3, where
DeepSpeed fails at ``initialize`` as in step 2 (the critic's value head), against DeepSpeed with
both at ZeRO-2 (the stages compute the same numbers). The script's ``--seed`` is given: without it
its data split is drawn from the operating system's entropy.

All in the slow tier: each case is two launches of W processes importing transformers and
DeepSpeed or zfunc (30-70 s each here).
"""
import json
import math
import os
import re

import pytest
import torch

from ds_scripts import SCRIPTS, launch, tiny_opt

CHAT = os.path.join(SCRIPTS, "deepspeed_chat")
PIPELINE = os.path.join(SCRIPTS, "pipeline_parallelism", "train.py")
CIFAR = os.path.join(SCRIPTS, "cifar10", "cifar10_deepspeed.py")


def chat_args(folder, model: str, stage: int) -> list[str]:
    return ["--data_path", "local/random", "--data_split", "6,2,2", "--data_output_path", os.path.join(folder, "data"),
            "--model_name_or_path", model, "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--max_seq_len", "16", "--learning_rate", "1e-3", "--weight_decay", "0.1", "--num_warmup_steps", "2",
            "--zero_stage", str(stage), "--dtype", "bf16", "--dropout", "0.0", "--print_loss"]


def evaluations(lines: list[str]) -> list[tuple[float, float]]:
    """DeepSpeed-Chat's ``ppl: P, loss: L`` (before and after the epoch; found in the whole stream,
    where another rank's line may run into rank 0's)."""
    return [(float(p), float(loss)) for p, loss in re.findall(r"ppl: (\S+), loss: (\d+\.\d+)", "\n".join(lines))]


@pytest.mark.slow
@pytest.mark.parametrize("world, stage", [(1, 2), (2, 2), (2, 1), (1, 3), (2, 3)],
                         ids=["W1-zero2", "W2-zero2", "W2-zero1", "W1-zero3", "W2-zero3"])
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
        # DeepSpeed-Chat trains in bf16 only (its --dtype is fp16 or bf16): after the first update the bf16
        # roundings of two reduction orders part by bf16's unit roundoff (2^-8); seen about 2e-4
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=1e-3, atol=0)
    ev, tv = evaluations(ours_out), evaluations(theirs_out)
    assert len(ev) == len(tv) == 2
    assert ev[0] == tv[0]  # the evaluation before training: the same weights
    torch.testing.assert_close(torch.tensor(ev[1]), torch.tensor(tv[1]), rtol=2e-3, atol=0)
    assert "\n".join(ours_out).count("Model Parameters:") == len(ours[0])  # print_throughput ran each step


def pipeline_config(folder) -> str:
    """The example's ds_config.json with a smaller batch, lr 1e-4 and clipping off (the module docstring)."""
    path = os.path.join(folder, "ds_config.json")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8}},
                   "steps_per_print": 10, "wall_clock_breakdown": False}, f)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("world, stages", [(2, 2), (1, 0), (2, 0)], ids=["W2-pipe2", "W1-data", "W2-data"])
def test_deepspeed_examples_pipeline_script_matches_deepspeed(world, stages, tmp_path):
    args = ["--deepspeed_config", pipeline_config(str(tmp_path)), "-p", str(stages), "--steps", "8",
            "--backend", "gloo"]
    _, theirs = launch(PIPELINE, args, world, str(tmp_path / "deepspeed"), zfunc=False)
    _, ours = launch(PIPELINE, args, world, str(tmp_path / "zfunc"), zfunc=True)
    per_step = 1 if stages else 16 // (4 * world)  # train_batch's mean, or each micro-batch's backward
    for rank in range(world):
        assert len(ours[rank]) == len(theirs[rank]) == 8 * per_step
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("world, stage", [(1, 0), (2, 1), (2, 2)], ids=["W1-zero0", "W2-zero1", "W2-zero2"])
def test_deepspeed_examples_cifar_script_matches_deepspeed(world, stage, tmp_path):
    args = ["--dtype", "fp32", "--stage", str(stage), "--epochs", "2", "--log-interval", "2"]
    theirs_out, theirs = launch(CIFAR, args, world, str(tmp_path / "deepspeed"), zfunc=False)
    ours_out, ours = launch(CIFAR, args, world, str(tmp_path / "zfunc"), zfunc=True)
    for rank in range(world):
        assert len(ours[rank]) == len(theirs[rank]) == 2 * 128 // 16
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=1e-5, atol=0)
    # rank 0 prints them; every rank prints "Finished Training" to the same stream, which may run into them
    accuracy = re.findall(r"Accuracy of [^%]*%", "\n".join(ours_out))
    assert len(accuracy) == 11 and accuracy == re.findall(r"Accuracy of [^%]*%", "\n".join(theirs_out))


def reward_args(folder, model: str, stage: int) -> list[str]:
    return ["--data_path", "local/random", "--data_split", "2,4,4", "--data_output_path", os.path.join(folder, "data"),
            "--model_name_or_path", model, "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--max_seq_len", "16", "--learning_rate", str(REWARD_LR), "--weight_decay", "0.1", "--num_warmup_steps", "2",
            "--zero_stage", str(stage), "--dtype", "bf16", "--dropout", "0.0", "--compute_fp32_loss",
            "--output_dir", os.path.join(folder, "critic")]


REWARD_LR = 1e-3


def reward_evaluations(lines: list[str]) -> list[tuple[float, float, float]]:
    """Step 2's ``chosen_last_scores ... : C, rejected_last_scores ... : R, acc ... : A`` lines."""
    return [tuple(map(float, m)) for m in re.findall(
        r"chosen_last_scores \(higher is better\) : (\S+), rejected_last_scores \(lower is better\) : (\S+), "
        r"acc \(higher is better\) : (\S+)", "\n".join(lines))]


@pytest.mark.slow
@pytest.mark.parametrize("world, stage", [(1, 2), (2, 2), (2, 1)], ids=["W1-zero2", "W2-zero2", "W2-zero1"])
def test_deepspeed_chat_step2_reward_model_matches_deepspeed(world, stage, tmp_path):
    model = tiny_opt(tmp_path / "tiny_opt")
    script = os.path.join(CHAT, "step2_reward_model_finetuning", "main.py")
    runs = {}
    for zfunc in (False, True):
        folder = str(tmp_path / ("zfunc" if zfunc else "deepspeed"))
        runs[zfunc] = launch(script, reward_args(folder, model, stage), world, folder, zfunc=zfunc, pythonpath=CHAT)
    (theirs_out, theirs), (ours_out, ours) = runs[False], runs[True]
    steps = math.ceil(38 / world / 2)  # 38 training pairs, padded to the ranks, 2 a micro-batch
    for rank in range(world):
        assert len(ours[rank]) == len(theirs[rank]) == steps, rank
        assert ours[rank][:2] == theirs[rank][:2]  # bit for bit: lr 0 at the first update (warm-up)
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=2e-2, atol=0)
    ev, tv = reward_evaluations(ours_out), reward_evaluations(theirs_out)
    assert len(ev) == len(tv) == 2 and ev[0] == tv[0]  # before training: the same model
    assert ev[1][2] == tv[1][2]  # the same accuracy after it
    torch.testing.assert_close(torch.tensor(ev[1][:2]), torch.tensor(tv[1][:2]), rtol=2e-2, atol=0)
    ours_critic, theirs_critic = (torch.load(tmp_path / which / "critic" / "pytorch_model.bin")
                                  for which in ("zfunc", "deepspeed"))
    assert list(ours_critic) == list(theirs_critic) and "v_head.weight" in ours_critic
    for name, t in theirs_critic.items():
        assert (ours_critic[name].shape, ours_critic[name].dtype) == (t.shape, t.dtype), name
        # Adam moves an element by about lr a step at most: two runs part by no more than twice that in all
        torch.testing.assert_close(ours_critic[name].float(), t.float(), rtol=0, atol=2 * REWARD_LR * steps)


@pytest.mark.slow
def test_deepspeed_chat_step2_reward_model_trains_at_zero3(tmp_path):
    """DeepSpeed fails here (the module docstring); zfunc's run: every step's loss finite, both
    evaluations printed, and the critic saved whole (``save_hf_format`` on rank 0 alone did not wait
    for the other rank, and ``save_zero_three_model`` gathered each weight)."""
    model = tiny_opt(tmp_path / "tiny_opt")
    script = os.path.join(CHAT, "step2_reward_model_finetuning", "main.py")
    folder = str(tmp_path / "zfunc")
    out, losses = launch(script, reward_args(folder, model, 3), 2, folder, zfunc=True, pythonpath=CHAT)
    assert [len(r) for r in losses] == [10, 10] and all(math.isfinite(x) for r in losses for x in r)
    assert len(reward_evaluations(out)) == 2
    critic = torch.load(os.path.join(folder, "critic", "pytorch_model.bin"))
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model)
    assert critic["v_head.weight"].shape == (1, config.hidden_size)
    assert critic["rwtransformer.decoder.embed_tokens.weight"].shape == (24, config.hidden_size)
    assert all(t.numel() > 0 and torch.isfinite(t.float()).all() for t in critic.values())


def dpo_evaluations(lines: list[str]) -> list[tuple[float, float, float]]:
    """DPO's ``chosen: C, rejected: R, loss: L`` evaluation lines."""
    return [tuple(map(float, m)) for m in re.findall(r"chosen: (\S+), rejected: (\S+), loss: (\S+)", "\n".join(lines))]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3], ids=["W2-zero2", "W2-zero3"])
def test_deepspeed_chat_step2_dpo_matches_deepspeed(stage, tmp_path):
    model = tiny_opt(tmp_path / "tiny_opt")
    script = os.path.join(CHAT, "step2_dpo_finetuning", "main.py")
    runs = {}
    for zfunc in (False, True):
        folder = str(tmp_path / ("zfunc" if zfunc else "deepspeed"))
        args = [a for a in reward_args(folder, model, stage) if a != "--compute_fp32_loss"]  # DPO has no such flag
        runs[zfunc] = launch(script, args, 2, folder, zfunc=zfunc, pythonpath=CHAT)
    (theirs_out, theirs), (ours_out, ours) = runs[False], runs[True]
    steps = math.ceil(38 / 2 / 2)
    for rank in range(2):
        assert len(ours[rank]) == len(theirs[rank]) == steps, rank
        assert ours[rank][:2] == theirs[rank][:2]
        # bf16 losses (in [0.5, 1): a unit in the last place is 2^-8): within two of them
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=2 ** -7, atol=0)
    ev, tv = dpo_evaluations(ours_out), dpo_evaluations(theirs_out)
    assert len(ev) == len(tv) == 2 and ev[0] == tv[0]  # before training: the same model
    torch.testing.assert_close(torch.tensor(ev[1]), torch.tensor(tv[1]), rtol=2 ** -7, atol=2 ** -12)
    ours_model, theirs_model = (torch.load(tmp_path / which / "critic" / "pytorch_model.bin")
                                for which in ("zfunc", "deepspeed"))
    assert list(ours_model) == list(theirs_model)
    # at ZeRO-3 save_zero_three_model saves what GatheredParameters shows: DeepSpeed's bf16 parameter,
    # zfunc's fp32 master weight (docs/deepspeed.md)
    dtype = torch.float32 if stage == 3 else torch.bfloat16
    for name, t in theirs_model.items():
        assert (ours_model[name].shape, ours_model[name].dtype, t.dtype) == (t.shape, dtype, torch.bfloat16), name
        torch.testing.assert_close(ours_model[name].float(), t.float(), rtol=0, atol=2 * REWARD_LR * steps)


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """The tiny OPT and a critic trained from it by step 2 on zfunc (W = 1, ZeRO-2)."""
    folder = tmp_path_factory.mktemp("chat_models")
    model = tiny_opt(folder / "tiny_opt")
    script = os.path.join(CHAT, "step2_reward_model_finetuning", "main.py")
    launch(script, reward_args(str(folder / "step2"), model, 2), 1, str(folder / "step2"), zfunc=True, pythonpath=CHAT)
    return model, str(folder / "step2" / "critic")


def ppo_args(folder, actor: str, critic: str, actor_stage: int, critic_stage: int) -> list[str]:
    return ["--data_path", "local/random", "--data_split", "2,4,4", "--data_output_path", os.path.join(folder, "data"),
            "--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic, "--num_padding_at_beginning", "1",
            "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2", "--generation_batches",
            "1", "--ppo_epochs", "1", "--max_prompt_seq_len", "8", "--max_answer_seq_len", "8", "--actor_learning_rate",
            "1e-3", "--critic_learning_rate", "1e-3", "--num_warmup_steps", "2", "--actor_zero_stage", str(actor_stage),
            "--critic_zero_stage", str(critic_stage), "--dtype", "bf16", "--actor_dropout", "0.0", "--seed", "1234",
            "--output_dir", os.path.join(folder, "out")]


@pytest.mark.slow
@pytest.mark.parametrize("ours_stages, theirs_stages", [((2, 2), (2, 2)), ((3, 2), (3, 2)), ((3, 3), (2, 2))],
                         ids=["zero2", "actor-zero3", "zero3-vs-their-zero2"])
def test_deepspeed_chat_step3_ppo_matches_deepspeed(ours_stages, theirs_stages, chat_models, tmp_path):
    actor, critic = chat_models
    script = os.path.join(CHAT, "step3_rlhf_finetuning", "main.py")
    runs = {}
    for zfunc, stages in ((False, theirs_stages), (True, ours_stages)):
        folder = str(tmp_path / ("zfunc" if zfunc else "deepspeed"))
        runs[zfunc] = launch(script, ppo_args(folder, actor, critic, *stages), 2, folder, zfunc=zfunc, pythonpath=CHAT)
    (theirs_out, theirs), (ours_out, ours) = runs[False], runs[True]
    for rank in range(2):
        assert len(ours[rank]) == len(theirs[rank]) > 6, rank  # an actor and a critic loss per PPO step
        assert ours[rank][:6] == theirs[rank][:6], rank
        torch.testing.assert_close(torch.tensor(ours[rank]), torch.tensor(theirs[rank]), rtol=0, atol=2 ** -8)
    rewards = [re.findall(r"Average reward score: (\S+)", "\n".join(out)) for out in (ours_out, theirs_out)]
    assert len(rewards[0]) == len(ours[0]) // 2 and rewards[0] == rewards[1]
    for which, ours_stage, theirs_stage in zip(("actor", "critic"), ours_stages, theirs_stages):
        if ours_stage != theirs_stage:  # ZeRO-3's save_zero_three_model writes named_parameters: no tied names
            continue
        saved = [torch.load(tmp_path / run / "out" / which / "pytorch_model.bin") for run in ("zfunc", "deepspeed")]
        assert list(saved[0]) == list(saved[1]), which
        assert all(saved[0][k].shape == saved[1][k].shape for k in saved[1]), which
