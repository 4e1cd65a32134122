"""Libraries that drive DeepSpeed themselves, unchanged, on zfunc (``ZFUNC_AS_DEEPSPEED=1``) and on
real DeepSpeed 0.19 (CPU accelerator, gloo) in the same environment, launched by torchrun
(tests/harness/ds_clients.py): every micro-batch's loss on every rank equal (fp32: 1e-5 relative).

- an ordinary Accelerate loop with its DeepSpeed plugin (``prepare``, ``accumulate``,
  ``backward``, ``optimizer.step()``, ``scheduler.step()``, ``unwrap_model``, ``get_state_dict``,
  ``save_state`` / ``load_state``), ZeRO-2 and ZeRO-3, at W = 1 and 2, and bf16 (within its bound);
  and ``accelerate launch --config_file`` with a ``deepspeed_config_file`` (ZeRO-2 and 3, W = 2);
- TRL's ``SFTTrainer`` (``SFTConfig(deepspeed=...)``, a text data set it tokenizes) under ZeRO-2 and
  ZeRO-3 (its fused LM head reads ``ds_status`` off the head's weight and the weight it saved) at
  W = 1 and 2;
- Lightning's ``DeepSpeedStrategy`` (ZeRO-2 at W = 1 and 2, ZeRO-3 at W = 2, with
  ``accumulate_grad_batches``; a checkpoint saved after 2 steps resumed by a new Trainer, ZeRO-2
  and 3), on the CPU through an accelerator that passes its CUDA-only check.

The launches are slow (two torchrun runs a case); the fast tests check in one process what these
clients ask of the engine that the Trainer does not: Accelerate's scheduler built on the script's
optimizer before ``prepare``; a head read outside its module as TRL's fused LM head reads it;
Lightning's resume restoring the scheduler it took; Lightning's scheduler taken
from the engine and stepped by it, ``optimizer.state``, ``model.cpu()`` at teardown and
``deepspeed.utils.logging.logger``."""
import contextlib
import copy
import functools
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zfunc.deepspeed as zds

import transformers  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
import accelerate  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)
import deepspeed  # noqa: F401  (declared in the test extra: a missing one must fail, not skip)

import ds_clients  # noqa: E402
import hf_trainer  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16's 8 bits of mantissa, over a few steps


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return F.cross_entropy(self.head(x), y)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_scheduler_built_on_the_scripts_optimizer_before_initialize_sets_the_lr(stage):
    """Accelerate's order: a torch scheduler on the script's own optimizer, made before ``prepare``
    (which passes ``initialize`` the optimizer and not the scheduler) and stepped after each update:
    the lr of each update is the one it writes into that optimizer's groups, as under DeepSpeed,
    whose optimizer holds those groups: equal to plain torch."""
    model = Net()
    reference = copy.deepcopy(model)
    lam = lambda k: [0.0, 1.0, 0.5, 0.25, 0.125][min(k, 4)]  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    engine, returned, _, _ = zds.initialize(model=model, optimizer=optimizer, config=config)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        engine.backward(engine(x, y))
        engine.step()
        scheduler.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
        ref_sched.step()
        assert returned.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for name, t in reference.named_parameters():
        torch.testing.assert_close(engine.params()[name], t.detach(), **FP32)
    engine.close()


class _HeadFunction(torch.autograd.Function):
    """TRL's chunked log-prob function's shape: it takes the head's weight, saves it for backward and,
    in the backward, asks the saved tensor for ``ds_status`` (to gather it if not available)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _seen.append(("backward", weight.ds_status))
        return grad @ weight, grad.t() @ x, grad.sum(0)


_seen: list = []


def _trl_like(model):
    """A forward that reads ``head.weight`` outside the head's forward, as TRL's fused LM head does,
    gathering it through ``GatheredParameters`` when its ``ds_status`` says it is not available."""
    from zfunc.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def forward(self, x, y):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        weight, bias = self.head.weight, self.head.bias
        _seen.append(("forward", weight.ds_status))
        gather = weight.ds_status != ZeroParamStatus.AVAILABLE
        with zds.zero.GatheredParameters([weight, bias]) if gather else contextlib.nullcontext():
            return F.cross_entropy(_HeadFunction.apply(x, weight, bias), y)
    model.forward = types.MethodType(forward, model)
    return model


def test_a_head_read_outside_its_module_reads_ds_status_as_under_deepspeed():
    """TRL's fused LM head under ZeRO-3, in small: the tensor the forward reads for ``head.weight``
    (the step's view) and the one its autograd function saved (a new tensor object in the backward)
    both read ``ds_status`` AVAILABLE, so nothing is gathered inside the step; the losses equal the
    plain model's. Outside the step the parameter reads NOT_AVAILABLE, and a tensor that is not
    ZeRO's has no ``ds_status``, as under DeepSpeed."""
    from zfunc.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    reference, *_ = zds.initialize(model=Net(), config=config)
    engine, *_ = zds.initialize(model=_trl_like(Net()), config=config)
    _seen.clear()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        losses = []
        for e in (engine, reference):
            losses.append(e(x, y))
            e.backward(losses[-1])
            e.step()
        torch.testing.assert_close(losses[0].detach(), losses[1].detach(), **FP32)
    assert _seen == [("forward", ZeroParamStatus.AVAILABLE), ("backward", ZeroParamStatus.AVAILABLE)] * 3, _seen
    assert engine.module.head.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert not hasattr(torch.zeros(2), "ds_status")
    engine.close()
    reference.close()


def _lightning_step(engine, scheduler, x, y, steps_per_update=1):
    """Lightning's DeepSpeed strategy: ``engine.backward``, ``engine.step()``, then the scheduler it
    took from the engine stepped ``steps_per_update`` times (once with ``interval="step"``)."""
    engine.backward(engine(x, y))
    engine.step()
    for _ in range(steps_per_update):
        scheduler.step()


def test_lightnings_resume_restores_the_scheduler_it_took(tmp_path):
    """Lightning's resume, in one process: the engine's ``load_checkpoint(load_lr_scheduler_states=False)``
    with the optimizer's states (the engine holds no scheduler: the script took it), then the taken
    scheduler's ``load_state_dict`` with the state saved at the same update, accepted; the next
    updates step it as before and train as the uninterrupted run. A state of another update is
    refused, naming ``load_checkpoint``."""
    lam = lambda k: [0.0, 1.0, 0.5, 0.25, 0.125][min(k, 4)]  # noqa: E731
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]

    def job():
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        engine, *_ = zds.initialize(model=model, optimizer=optimizer, config=config,
                                    lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lam))
        scheduler, engine.lr_scheduler = engine.lr_scheduler, None
        return engine, scheduler

    whole, whole_sched = job()
    for x, y in data:
        _lightning_step(whole, whole_sched, x, y)
    first, first_sched = job()
    for x, y in data[:2]:
        _lightning_step(first, first_sched, x, y)
    first.save_checkpoint(str(tmp_path), tag="checkpoint")
    saved = first_sched.state_dict()
    first.close()
    resumed, sched = job()
    resumed.load_checkpoint(str(tmp_path), tag="checkpoint", load_optimizer_states=True,
                            load_lr_scheduler_states=False)
    with pytest.raises(NotImplementedError, match="load_checkpoint"):
        sched.load_state_dict({**saved, "last_epoch": saved["last_epoch"] + 1})
    sched.load_state_dict(saved)
    for x, y in data[2:]:
        _lightning_step(resumed, sched, x, y)
    for name, t in whole.params().items():
        torch.testing.assert_close(resumed.params()[name], t, **FP32)
    assert sched.get_last_lr() == whole_sched.get_last_lr()
    resumed.close()
    whole.close()


def test_what_lightnings_deepspeed_strategy_does_with_the_engine():
    """The scheduler taken from the engine (``engine.lr_scheduler = None``) and stepped once per
    update trains as plain torch; stepped otherwise (an "epoch" interval) it is refused by name;
    ``optimizer.state`` is an empty mapping (its teardown walks it); ``model.cpu()`` after the fit
    leaves the engine's weights in place, a dtype cast is refused; ``deepspeed.utils.logging.logger``."""
    model = Net()
    reference = copy.deepcopy(model)
    lam = lambda k: [0.0, 1.0, 0.5, 0.25, 0.125][min(k, 4)]  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}
    engine, returned, _, _ = zds.initialize(model=model, optimizer=optimizer, config=config,
                                            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lam))
    scheduler, engine.lr_scheduler = engine.lr_scheduler, None
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    for x, y in data[:3]:
        _lightning_step(engine, scheduler, x, y)
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
        ref_sched.step()
    for name, t in reference.named_parameters():
        torch.testing.assert_close(engine.params()[name], t.detach(), **FP32)
    with pytest.raises(NotImplementedError, match="interval='step'"):
        _lightning_step(engine, scheduler, *data[3], steps_per_update=2)
    assert dict(returned.state) == {}
    before = {n: t.clone() for n, t in engine.params().items()}
    assert model.cpu() is model
    for name, t in engine.params().items():
        torch.testing.assert_close(t, before[name], rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="bf16"):
        model.half()
    engine.close()
    from zfunc.deepspeed.utils import logging
    assert logging.logger.name == "DeepSpeed"


# ------------------------------------------------------------------ against real DeepSpeed


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return hf_trainer.save_model_folder(str(tmp_path_factory.mktemp("tiny_llama")))


def _config(stage: int, **extra) -> dict:
    """An Accelerate user's DeepSpeed config: "auto" where Accelerate fills it (from the loader's batch
    size and the plugin), the 16-bit weights gathered for ``get_state_dict`` under ZeRO-3."""
    cfg = hf_trainer.ds_config(stage)
    cfg["bf16"] = {"enabled": False}
    return {**cfg, **extra}


def _both(tmp_path, client, world, case):
    ours = ds_clients.run("zfunc", client, case, str(tmp_path / "zfunc"), world)
    theirs = ds_clients.run("deepspeed", client, case, str(tmp_path / "deepspeed"), world)
    assert all("+zfunc" in r["deepspeed"] for r in ours) and not any("+zfunc" in r["deepspeed"] for r in theirs)
    return ours, theirs


def _same(ours, theirs, keys=("losses",), tol=FP32):
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in keys:
            assert len(a[key]) == len(b[key]) and a[key], (rank, key, a[key], b[key])
            torch.testing.assert_close(torch.tensor(a[key], dtype=torch.float64),
                                       torch.tensor(b[key], dtype=torch.float64), **tol,
                                       msg=lambda m: f"rank {rank} {key}: {a[key]} vs DeepSpeed {b[key]}\n{m}")


def _same_state_dicts(tmp_path, tol=FP32):
    ours, theirs = (torch.load(tmp_path / w / "state_dict.pt") for w in ("zfunc", "deepspeed"))
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        torch.testing.assert_close(t, theirs[name], **tol, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_loop(tmp_path, model_folder, stage, world):
    """Four updates with a torch AdamW and transformers' linear warmup scheduler; ``get_state_dict``
    after them equal to DeepSpeed's."""
    case = {"model": model_folder, "config": _config(stage), "steps": 4}
    ours, theirs = _both(tmp_path, "accelerate", world, case)
    _same(ours, theirs, keys=("losses", "lrs"))
    assert {r["unwrapped"] for r in ours + theirs} == {"LlamaForCausalLM"}
    _same_state_dicts(tmp_path)


@pytest.mark.slow
def test_accelerate_loop_bf16(tmp_path, model_folder):
    """The config's ``bf16`` at ZeRO-2, W = 2: losses and ``get_state_dict`` within bf16's bound."""
    case = {"model": model_folder, "config": _config(2, bf16={"enabled": True}), "steps": 4}
    ours, theirs = _both(tmp_path, "accelerate", 2, case)
    _same(ours, theirs, tol=BF16)
    _same_state_dicts(tmp_path, BF16)


@pytest.mark.slow
def test_accelerate_loop_save_state_and_load_state(tmp_path, model_folder):
    """ZeRO-3 at W = 2: ``save_state`` after two updates, two more, then ``load_state`` and the last two
    again: the same losses as the first time, and as DeepSpeed's."""
    case = {"model": model_folder, "config": _config(3), "steps": 4, "resume_at": 2}
    ours, theirs = _both(tmp_path, "accelerate", 2, case)
    _same(ours, theirs, keys=("losses", "resumed"))
    for r in ours:
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["losses"][2:]), **FP32)


@pytest.mark.slow
def test_accelerate_loop_accumulating_with_the_configs_optimizer(tmp_path, model_folder):
    """ZeRO-3 at W = 2, ``accumulate`` over two micro-batches (the plugin's ``gradient_accumulation_steps``),
    the config's AdamW and WarmupDecayLR through ``DummyOptim`` / ``DummyScheduler``."""
    config = _config(3, optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                               "betas": [0.9, 0.999], "eps": 1e-8}},
                     scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                   "warmup_num_steps": "auto",
                                                                   "total_num_steps": "auto"}})
    ours, theirs = _both(tmp_path, "accelerate", 2, {"model": model_folder, "config": config, "gas": 2, "steps": 3})
    _same(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_trl_sft_trainer_zero2(tmp_path, model_folder, world):
    """TRL's SFTTrainer tokenizing a text data set itself, ZeRO-2 with two micro-batches an update:
    losses, the logged gradient norms, lrs and TRL's mean token accuracy equal DeepSpeed's."""
    case = {"model": model_folder, "config": hf_trainer.ds_config(2), "gas": 2, "steps": 3}
    ours, theirs = _both(tmp_path, "trl", world, case)
    _same(ours, theirs, keys=("losses", "grad_norm", "learning_rate", "mean_token_accuracy"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_trl_sft_trainer_zero3(tmp_path, model_folder, world):
    """TRL's SFTTrainer under ZeRO-3, its fused LM head included (it reads ``ds_status`` off
    ``lm_head.weight`` in the forward and off the weight it saved, in the backward), two micro-batches
    an update: losses, the logged gradient norms, lrs and TRL's mean token accuracy equal DeepSpeed's."""
    case = {"model": model_folder, "config": hf_trainer.ds_config(3), "gas": 2, "steps": 3}
    ours, theirs = _both(tmp_path, "trl", world, case)
    _same(ours, theirs, keys=("losses", "grad_norm", "learning_rate", "mean_token_accuracy"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trl_dpo_trainer_with_a_reference_model(tmp_path, model_folder, stage):
    """TRL's DPOTrainer, W = 2: the policy trained by the engine, the reference model made by TRL's
    ``prepare_deepspeed`` (``deepspeed.initialize`` with no optimizer; ZeRO-3 sharded, else stage 0;
    its bucket sizes as top-level paths). Losses, gradient norms, rewards and log-probabilities of
    chosen and rejected answers equal DeepSpeed's."""
    case = {"model": model_folder, "config": hf_trainer.ds_config(stage), "steps": 4}
    ours, theirs = _both(tmp_path, "trl_dpo", 2, case)
    _same(ours, theirs, keys=("loss", "grad_norm", "rewards_chosen", "rewards_rejected", "logps_chosen",
                              "logps_rejected"))


@pytest.mark.slow
@pytest.mark.parametrize("stage, beta", [(2, 0.04), (3, 0.0), (3, 0.04)])
def test_trl_grpo_trainer_generates_and_trains(tmp_path, model_folder, stage, beta):
    """TRL's GRPOTrainer, W = 2: completions sampled with ``generate`` on the trained model (under
    ZeRO-3 inside ``GatheredParameters``, DeepSpeed's module hooks removed and registered again),
    rewarded by a function, the policy stepped; ``beta`` > 0 adds TRL's reference model. The sampled
    completions' rewards, the losses and the gradient norms equal DeepSpeed's."""
    case = {"model": model_folder, "config": hf_trainer.ds_config(stage), "steps": 3, "beta": beta}
    ours, theirs = _both(tmp_path, "trl_grpo", 2, case)
    _same(ours, theirs, keys=("reward", "loss", "grad_norm"))


@pytest.mark.slow
def test_trl_reward_trainer_zero3(tmp_path, model_folder):
    """TRL's RewardTrainer, a sequence-classification head on the tiny Llama, ZeRO-3 at W = 2: losses,
    gradient norms and accuracies equal DeepSpeed's."""
    case = {"model": model_folder, "config": hf_trainer.ds_config(3), "steps": 3}
    ours, theirs = _both(tmp_path, "trl_reward", 2, case)
    _same(ours, theirs, keys=("loss", "grad_norm", "accuracy"))


def _accelerate_launch(folder, stage: int, zfunc: bool) -> list[dict]:
    """``accelerate launch --config_file`` (``distributed_type: DEEPSPEED`` with a
    ``deepspeed_config_file``, two processes on the CPU) of tests/harness/ds_accelerate_script.py,
    with the switch on or off; each rank's record."""
    import json
    import os
    import subprocess
    import sys
    os.makedirs(folder, exist_ok=True)
    ds_json, yaml = os.path.join(folder, "ds_config.json"), os.path.join(folder, "accelerate.yaml")
    with open(ds_json, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": stage}}, f)
    with open(yaml, "w") as f:
        f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                f"  deepspeed_config_file: {ds_json}\n  zero3_init_flag: false\nnum_processes: 2\n"
                "num_machines: 1\nmachine_rank: 0\nmain_training_function: main\nuse_cpu: true\n")
    script = os.path.join(os.path.dirname(ds_clients.__file__), "ds_accelerate_script.py")
    out = os.path.join(folder, "record")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               ZFUNC_AS_DEEPSPEED="1" if zfunc else "0")
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", yaml, script, out],
                          capture_output=True, text=True, timeout=600, env=env, cwd=folder)
    assert done.returncode == 0, done.stderr[-6000:]
    records = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            records.append(json.load(f))
    return records


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_with_a_deepspeed_config_file(tmp_path, stage):
    """``accelerate launch --config_file`` naming a DeepSpeed config file runs an unchanged Accelerate
    script (``Accelerator()`` with no plugin: the launcher's environment says DeepSpeed) on zfunc's
    engine with the switch on, on DeepSpeed's with it off: every rank's losses equal to 1e-5."""
    ours = _accelerate_launch(str(tmp_path / "zfunc"), stage, True)
    theirs = _accelerate_launch(str(tmp_path / "deepspeed"), stage, False)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["engine"] == "zfunc.deepspeed.engine" and b["engine"] == "deepspeed.runtime.engine", rank
        assert len(a["losses"]) == len(b["losses"]) == 8, rank
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **FP32)


@pytest.mark.slow
@pytest.mark.parametrize("configure_model", [False, True])
def test_lightning_model_checkpoint_callback(tmp_path, model_folder, configure_model):
    """Lightning's ``ModelCheckpoint`` callback writes the checkpoint after 2 steps (its state, with
    tensors, in the client state) and a new Trainer resumes from that file to step 4, ZeRO-3, W = 2:
    the callback wrote the same checkpoints as under DeepSpeed and the last lr is DeepSpeed's.
    Model from ``__init__``: every loss equals DeepSpeed's. Model built from its config in
    ``configure_model`` (inside the strategy's ``zero.Init``): it trains and resumes; its initial
    values are not DeepSpeed's, whose ``zero.Init`` partitions each parameter as it is made, so
    transformers' own init then writes nothing (the first loss differs from a plain build's under
    DeepSpeed too; docs/deepspeed.md)."""
    case = {"model": model_folder, "config": _lightning_config(3), "steps": 4, "resume_at": 2, "callback": True,
            "configure_model": configure_model}
    ours, theirs = _both(tmp_path, "lightning", 2, case)
    _same(ours, theirs, keys=("lrs",) if configure_model else ("losses", "lrs"))
    for a, b in zip(ours, theirs):
        assert a["checkpoints"] == b["checkpoints"] == ["epoch=0-step=2.ckpt"], (a, b)
        assert len(a["losses"]) == len(b["losses"]) == 4 and a["resumed_from"] == 2, (a, b)
        assert all(math.isfinite(x) for x in a["losses"]), a


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_fabric_deepspeed_strategy(tmp_path, model_folder, stage):
    """Lightning Fabric's DeepSpeedStrategy, W = 2 (its distributed sampler): ``fabric.setup``,
    ``fabric.backward``, ``optimizer.step()`` (Fabric steps the optimizer it returned, never the
    engine), ``fabric.save`` after 2 steps and ``fabric.load`` into a fresh model and optimizer set up
    again: every loss equal to DeepSpeed's, and the saved step count comes back."""
    case = {"model": model_folder, "config": _lightning_config(stage), "steps": 4, "resume_at": 2}
    ours, theirs = _both(tmp_path, "fabric", 2, case)
    _same(ours, theirs)
    assert [r["resumed_step"] for r in ours + theirs] == [2] * 4


def _lightning_config(stage: int) -> dict:
    """What a Lightning user gives ``DeepSpeedStrategy(config=...)``: the optimizer and scheduler come
    from ``configure_optimizers``."""
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2,
            "zero_allow_untested_optimizer": True}


@pytest.mark.slow
@pytest.mark.parametrize("stage, world, gas", [(2, 1, 1), (2, 2, 2), (3, 2, 2)])
def test_lightning_deepspeed_strategy(tmp_path, model_folder, stage, world, gas):
    """Lightning's DeepSpeedStrategy fitting a LightningModule (AdamW, a per-step warmup scheduler,
    ``accumulate_grad_batches``, ``gradient_clip_val``) on the CPU through ``cpu_as_cuda()`` (its
    strategy refuses any but its CUDA accelerator): every loss equal to DeepSpeed's."""
    case = {"model": model_folder, "config": _lightning_config(stage), "gas": gas, "steps": 3}
    ours, theirs = _both(tmp_path, "lightning", world, case)
    _same(ours, theirs, keys=("losses", "lrs"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_resumes_from_its_checkpoint(tmp_path, model_folder, stage):
    """Lightning's ``trainer.save_checkpoint`` after 2 steps (the engine's ``save_checkpoint`` with
    Lightning's state as client state), then a new Trainer's ``fit(ckpt_path=)`` to step 4: the engine's
    ``load_checkpoint`` restores the update count, and the scheduler's state Lightning loads next is
    accepted as the same update's. Every loss, the resumed job's included, and the last lr equal
    DeepSpeed's (W = 2)."""
    case = {"model": model_folder, "config": _lightning_config(stage), "steps": 4, "resume_at": 2}
    ours, theirs = _both(tmp_path, "lightning", 2, case)
    _same(ours, theirs, keys=("losses", "lrs"))
    for a, b in zip(ours, theirs):
        assert a["resumed_from"] == b["resumed_from"] == 2 and len(a["losses"]) == len(b["losses"]) > 2


@pytest.mark.slow
def test_lightning_refuses_deepspeed_on_its_cpu_accelerator(tmp_path, model_folder):
    """Why the test above needs ``cpu_as_cuda()``: Lightning itself refuses its DeepSpeed strategy on
    its CPU accelerator, with real DeepSpeed (zfunc is refused the same way)."""
    case = {"model": model_folder, "config": _lightning_config(2), "steps": 1, "cpu_accelerator": True}
    with pytest.raises(AssertionError, match="only supported on CUDA GPUs"):
        ds_clients.run("deepspeed", "lightning", case, str(tmp_path / "deepspeed"), 1)
