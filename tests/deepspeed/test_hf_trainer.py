"""transformers' ``Trainer`` with a DeepSpeed config, unchanged, on zfunc (``zfunc.deepspeed.install()``)
and on real DeepSpeed 0.19 (CPU accelerator, gloo) in the same environment, launched by torchrun
(tests/harness/hf_trainer.py): every micro-batch's loss on every rank equal (fp32 to 1e-5
relative, bf16 within its bound), the Trainer's logged gradient norms and lrs too, at W = 1 and 2,
under ZeRO-2, ZeRO-3, optimizer offload to the CPU, bf16, gradient accumulation, a peft LoRA
model, a resume from a checkpoint, and ``save_model``'s folder read by ``from_pretrained``."""
import json
import os

import pytest
import torch

import transformers  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
import accelerate  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
import deepspeed  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)

import hf_trainer as harness  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16's 8 bits of mantissa, over a few steps


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return harness.save_model_folder(str(tmp_path_factory.mktemp("tiny_llama")))


def _both(tmp_path, model_folder, world, config, **case):
    case = {"model": model_folder, "config": config, **case}
    ours = harness.run("zfunc", case, str(tmp_path / "zfunc"), world)
    theirs = harness.run("deepspeed", case, str(tmp_path / "deepspeed"), world)
    return ours, theirs


def _same(ours, theirs, tol=FP32, keys=("losses", "grad_norms", "lrs")):
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in keys:
            assert len(a[key]) == len(b[key]) and a[key], (rank, key, a[key], b[key])
            torch.testing.assert_close(torch.tensor(a[key], dtype=torch.float64),
                                       torch.tensor(b[key], dtype=torch.float64), **tol,
                                       msg=lambda m: f"rank {rank} {key}: {a[key]} vs DeepSpeed {b[key]}\n{m}")


@pytest.mark.slow
def test_zero3_with_accumulation(tmp_path, model_folder):
    """ZeRO-3, two micro-batches an update, one rank (slow, as all here: two torchrun launches a case;
    test_hf_engine.py checks the engine's face the Trainer uses in the fast tier)."""
    ours, theirs = _both(tmp_path, model_folder, 1, harness.ds_config(3), gas=2, steps=3)
    _same(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages(tmp_path, model_folder, stage, world):
    ours, theirs = _both(tmp_path, model_folder, world, harness.ds_config(stage), steps=4)
    _same(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_at_two_ranks(tmp_path, model_folder, stage):
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(stage), gas=2, steps=3)
    _same(ours, theirs)


@pytest.mark.slow
def test_from_pretrained_after_the_arguments(tmp_path, model_folder):
    """The TrainingArguments first, as most scripts have it: from_pretrained takes transformers'
    ZeRO-3 path (zero.Init, GatheredParameters, zfunc's spill); the run equals DeepSpeed's, and the
    one that built the model first."""
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3), steps=4, args_first=True)
    _same(ours, theirs)
    first = harness.run("zfunc", {"model": model_folder, "config": harness.ds_config(3), "steps": 4},
                        str(tmp_path / "model_first"), 2)
    _same(ours, first)


@pytest.mark.slow
def test_optimizer_offload_to_cpu(tmp_path, model_folder):
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3, offload=True), steps=4)
    _same(ours, theirs)


@pytest.mark.slow
def test_the_configs_optimizer_and_scheduler(tmp_path, model_folder):
    """"optimizer" and "scheduler" in the config: accelerate's DummyOptim / DummyScheduler path."""
    config = harness.ds_config(3, optimizer=True, scheduler=True)
    ours, theirs = _both(tmp_path, model_folder, 2, config, steps=4)
    _same(ours, theirs)


@pytest.mark.slow
def test_bf16(tmp_path, model_folder):
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3), bf16=True, steps=4)
    _same(ours, theirs, BF16, keys=("losses", "lrs"))


@pytest.mark.slow
def test_peft_lora_on_a_model_loaded_after_the_arguments(tmp_path, model_folder):
    """A peft model made on a base loaded under ZeRO-3 (the arguments first): the base's parameters are
    DeepSpeed's 0-element placeholders on the CPU, so peft makes its adapters there, real, with its own
    init, and wraps the base layers (``q_proj.weight`` is then ``q_proj.base_layer.weight``, read from
    the spill under its first name). The first two losses equal DeepSpeed's to the bit (the base's
    weights; lora_B is zero and the first update is at lr 0); the later ones part by ~1e-4
    (lora_A's random draws differ from DeepSpeed's: not traced further), within 1e-3."""
    import peft  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3), lora=True, steps=4, args_first=True)
    for a, b in zip(ours, theirs):
        assert a["losses"][:2] == b["losses"][:2]
    _same(ours, theirs, tol=dict(rtol=1e-3, atol=0), keys=("losses",))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_peft_lora(tmp_path, model_folder, stage):
    import peft  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(stage), lora=True, steps=4)
    _same(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("evaluate", ["only", "after"])
def test_evaluate(tmp_path, model_folder, evaluate):
    """The Trainer's ``evaluate()`` at ZeRO-3, W = 2: alone (transformers makes an engine for inference,
    with no optimizer) and after training: the eval loss, and the training's, equal DeepSpeed's."""
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3), steps=3, evaluate=evaluate)
    if evaluate == "after":
        _same(ours, theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a["eval_loss"], b["eval_loss"], **FP32)


@pytest.mark.slow
def test_resume_from_checkpoint(tmp_path, model_folder):
    """Checkpoints every 2 steps; a new job resumes from checkpoint-2 and takes steps 3 and 4 as the
    first one took them, under zfunc as under DeepSpeed."""
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3), steps=4, save_steps=2)
    _same(ours, theirs)
    resumed = {}
    for which in ("zfunc", "deepspeed"):
        case = {"model": model_folder, "config": harness.ds_config(3), "steps": 4, "save_steps": 2,
                "resume_from": str(tmp_path / which / "run" / "checkpoint-2")}
        resumed[which] = harness.run(which, case, str(tmp_path / f"{which}_resumed"), 2)
    for first, again in zip(ours, resumed["zfunc"]):
        half = len(first["losses"]) // 2
        torch.testing.assert_close(torch.tensor(again["losses"]), torch.tensor(first["losses"][half:]), **FP32)
    _same(resumed["zfunc"], resumed["deepspeed"])


@pytest.mark.slow
def test_save_model_loads_with_from_pretrained(tmp_path, model_folder):
    import transformers
    ours, theirs = _both(tmp_path, model_folder, 2, harness.ds_config(3), steps=2, save_model=True)
    _same(ours, theirs)
    loaded = {}
    for which in ("zfunc", "deepspeed"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / which / "model"),
                                                                         output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (which, info)
        loaded[which] = model.state_dict()
    assert loaded["zfunc"].keys() == loaded["deepspeed"].keys()
    for name, t in loaded["zfunc"].items():
        torch.testing.assert_close(t, loaded["deepspeed"][name], **FP32, msg=name)
