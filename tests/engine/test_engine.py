"""The engine (zf.initialize): the config composed into the step a user would write by hand,
the loop, the imperative style, checkpoints across world sizes, a Hugging Face client."""
import copy
import os

import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from cases import LR
from engines import GLOBAL_MICRO, engine_config, gpt_loss, hf_batch, hf_gpt2, hf_reference, micro_batches
from models import batch, build, local, loss
from workers import workers

def engine_run(config: dict, steps: int, imperative: bool = False, save_at: int | None = None,
               directory: str | None = None, load: bool = False) -> dict:
    model = build("gpt")
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, config, loss_fn=gpt_loss)
    start = 0
    if load:
        engine.load_checkpoint(directory)
        start = engine.global_steps
    data = micro_batches("gpt", shape, rank, world, engine.gradient_accumulation_steps(), start)
    losses = []
    for i in range(steps):
        if imperative:
            for _ in range(engine.gradient_accumulation_steps()):
                value = engine(next(data))
                engine.backward(value)
                engine.step()
            losses.append(float(engine.last_metrics["loss"]))
        else:
            losses.append(float(engine.train_batch(data)))
        if save_at is not None and engine.global_steps == save_at:
            engine.save_checkpoint(directory)
    out = {"params": engine.params(), "losses": losses, "steps": engine.global_steps,
           "samples": engine.global_samples, "lr": engine.get_lr()}
    engine.close()
    return out


def by_hand(stage: int, steps: int, gas: int, clip: float, precision: str | None) -> dict:
    """The same training, composed by hand as the README says."""
    model = build("gpt")
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()

    def loss_fn(params, b):
        return loss("gpt", zf.apply(model, params, b[0]), b[1])

    opt = zf.optim.chain(zf.optim.clip_by_global_norm(clip), zf.optim.adamw(LR, weight_decay=0.01))
    step = zf.accumulate(zf.train_step(loss_fn, opt), gas)
    if precision == "bf16":
        step = zf.mixed_precision(step, torch.bfloat16)
    step = {1: zf.zero1, 2: zf.zero2, 3: lambda s: zf.zero3(s, persistence_threshold=100_000)}[stage](step)
    state = step.init(model)
    data = micro_batches("gpt", shape, rank, world, gas)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, [next(data) for _ in range(gas)])
        losses.append(float(metrics["loss"]))
    return {"params": zf.gather_params(state), "losses": losses}


@pytest.mark.parametrize("stage,precision", [(1, None), (2, "bf16"), (3, None), (3, "bf16")])
def test_train_batch_equals_the_step_composed_by_hand(stage, precision):
    config = engine_config(stage, gradient_clipping=0.5, **({"bf16": {"enabled": True}} if precision else {}))
    for e, h in zip(workers(2).run(engine_run, config, 3), workers(2).run(by_hand, stage, 3, 2, 0.5, precision)):
        assert e["losses"] == h["losses"]
        for k in h["params"]:
            assert torch.equal(e["params"][k], h["params"][k]), k
        assert e["steps"] == 3 and e["samples"] == 3 * 2 * GLOBAL_MICRO


def test_the_imperative_style_gives_the_same_steps():
    config = engine_config(3)
    for a, b in zip(workers(2).run(engine_run, config, 3), workers(2).run(engine_run, config, 3, True)):
        assert a["losses"] == b["losses"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k


def composed(config: dict) -> tuple[str, str]:
    engine = zf.initialize(build("gpt"), config, loss_fn=gpt_loss)
    out = engine.step_fn.composition, engine.eval_fn.composition
    engine.close()
    return out


@pytest.mark.parametrize("precision,imperative", [(None, False), ("bf16", True)])
def test_offload_param_to_cpu_composes_the_cpu_tier(precision, imperative):
    """``offload_param: {"device": "cpu"}`` is ``zero3(offload_cpu(f, params=True))``; on the CPU it
    trains bit for bit as zero3 without it (with or without offload_optimizer)."""
    extra = {"bf16": {"enabled": True}} if precision else {}
    plain = engine_config(3, gradient_clipping=0.5, **extra)
    plain["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # else gpt's units all stay whole
    tier = copy.deepcopy(plain)
    tier["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if imperative:
        tier["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (train, evaluate), = workers(1).run(composed, tier)
    inner = "mixed_precision(accumulate(train_step, 2), bfloat16)" if precision else "accumulate(train_step, 2)"
    assert train == f"zero3(offload_cpu({inner}, params=True))"
    assert "params=True" in evaluate
    for a, b in zip(workers(2).run(engine_run, plain, 3, imperative), workers(2).run(engine_run, tier, 3, imperative)):
        assert a["losses"] == b["losses"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_checkpoint_at_two_resumes_at_one_and_three(stage, tmp_path):
    """Counters, the schedule and the weights carry over; training goes on as if uninterrupted."""
    config = engine_config(stage, scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": LR, "warmup_num_steps": 3,
                                                                      "warmup_type": "linear"}})
    directory = str(tmp_path / "ckpt")
    [whole, _] = workers(2).run(engine_run, config, 4)
    workers(2).run(engine_run, config, 2, False, 2, directory)
    for world in (1, 3):
        for r in workers(world).run(engine_run, config, 2, False, None, directory, True):
            assert r["steps"] == 4 and r["samples"] == whole["samples"] and r["lr"] == whole["lr"]
            assert_close_to(r["params"], whole["params"])


def eval_then_train(config: dict) -> dict:
    """eval_batch and train_batch on the same micro-batches of a fresh engine."""
    model = build("gpt")
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, config, loss_fn=gpt_loss)
    evaluated = float(engine.eval_batch(micro_batches("gpt", shape, rank, world, engine.gradient_accumulation_steps())))
    before = engine.params()
    trained = float(engine.train_batch(micro_batches("gpt", shape, rank, world, engine.gradient_accumulation_steps())))
    return {"eval": evaluated, "train": trained, "unchanged": before, "steps": engine.global_steps}


def test_eval_batch_is_the_loss_without_the_update():
    for r in workers(2).run(eval_then_train, engine_config(3)):
        assert r["eval"] == pytest.approx(r["train"], rel=1e-6) and r["steps"] == 1


def test_a_line_every_steps_per_print(capsys):
    [r] = workers(1).run(_print_run)
    lines = [line for line in r.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2", "step 4"]
    for part in ("loss ", "lr ", "tokens/s", "rss "):
        assert part in lines[0]


def _print_run() -> str:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        engine_run(engine_config(3, gas=1, steps_per_print=2), 4)
    return err.getvalue()


def test_repeating_loader_cycles():
    it = iter(zf.RepeatingLoader([1, 2, 3]))
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_bad_use_is_named():
    model = build("gpt")
    with pytest.raises(ValueError, match="both in the config"):
        zf.initialize(model, engine_config(3), loss_fn=gpt_loss, optimizer=zf.optim.adamw(1e-3))
    config = engine_config(3)
    del config["optimizer"]
    with pytest.raises(ValueError, match="no optimizer"):
        zf.initialize(model, config, loss_fn=gpt_loss)
    engine = zf.initialize(build("gpt"), engine_config(3, gas=2), loss_fn=gpt_loss)
    with pytest.raises(StopIteration, match="1 of the 2 micro-batches"):
        engine.train_batch(iter([local(batch("gpt", build("gpt"), 0, GLOBAL_MICRO), 0, 1)]))
    with pytest.raises(ValueError, match="single number, got a tensor of shape .* pass loss_fn"):
        zf.initialize(build("gpt"), engine_config(3, gas=1)).train_batch(iter([torch.zeros(1, 6, dtype=torch.long)]))


# ----------------------------------------------------------------------- Hugging Face GPT-2

def hf_engine(steps: int, config: dict) -> dict:
    model = hf_gpt2()
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, config)

    def data():
        k = 0
        while True:
            b = hf_batch(k)
            n = 4 // world
            yield {key: v[rank * n:(rank + 1) * n] for key, v in b.items()}
            k += 1

    it = data()
    losses = [float(engine.train_batch(it)) for _ in range(steps)]
    out = {"params": engine.params(), "losses": losses}
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_hugging_face_gpt2_through_the_engine_equals_plain_pytorch(stage):
    """GPT2LMHeadModel (tied head) from a config, DeepSpeed's default clipping at 1.0, W = 2."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    expected = hf_reference(3, 2, 1.0)
    for r in workers(2).run(hf_engine, 3, config):
        assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        got = {k: v for k, v in r["params"].items() if k in expected["params"]}
        assert_close_to(got, {k: expected["params"][k] for k in got})


@pytest.mark.slow
def test_hf_example_saves_and_resumes(tmp_path):
    """examples/hf_gpt2.py: train, save, resume from the checkpoint (single process)."""
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_gpt2.py")
    ckpt = str(tmp_path / "ckpt")
    common = [sys.executable, example, "--steps", "3", "--mb", "0.2", "--seq", "32"]
    first = subprocess.run(common + ["--save", ckpt], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run(common + ["--resume", ckpt], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step 6:" in second.stderr


@pytest.mark.slow
def test_hf_example_under_torchrun_with_two_processes(tmp_path):
    """examples/hf_gpt2.py under torchrun --nproc_per_node 2: train, save, resume."""
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_gpt2.py")
    ckpt = str(tmp_path / "ckpt")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", example,
           "--steps", "2", "--mb", "0.2", "--seq", "32"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(run + ["--save", ckpt], capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run(run + ["--resume", ckpt], capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step 4:" in second.stderr
    assert sorted(os.listdir(os.path.join(ckpt, "global_step2"))) == [
        "manifest.json", "rank0.bin", "rank0.json", "rank1.bin", "rank1.json"]
