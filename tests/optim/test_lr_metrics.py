"""``metrics["lr"]``: every train step reports the lr its update used, under every composition and
in the engine; a skipped step reports the lr it would have used, which the next applied update
uses (the schedule sees the optimizer's update count, not the step count)."""
import os
import tempfile

import pytest
import torch
from torch import nn

import zfunc as zf
from workers import workers
from zfunc import optim

STEPS = 5
SCHEDULE = dict(init_value=1e-3, peak_value=5e-3, warmup_steps=2, decay_steps=6)


def schedule():
    return optim.warmup_cosine_decay(**SCHEDULE)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 2))


def _compose(name: str, base, swap_dir: str):
    if name == "zero3":
        return zf.zero3(base)
    if name == "zero1+offload_cpu":
        return zf.zero1(zf.offload_cpu(base))
    if name == "offload_nvme":  # pieces of 16 elements: each piece's update gets its own GradInfo copy
        return zf.zero3(zf.offload_nvme(base, swap_dir, buffer_size=16, sub_group_size=16))
    if name == "accumulate":
        return zf.zero2(zf.accumulate(base, 2))
    if name == "bf16+clip+sgd":
        return zf.zero1(zf.mixed_precision(base, torch.bfloat16))
    raise ValueError(name)


def reported_lrs(name: str, steps: int) -> dict:
    """The lr each step reported and the parameters' change per step, on this rank."""
    model = _model()
    rank = zf.dist.rank()
    opt = (optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(schedule(), momentum=0.9))
           if "sgd" in name else optim.adamw(schedule()))
    with tempfile.TemporaryDirectory() as tmp:
        base = zf.train_step(lambda p, b: ((zf.apply(model, p, b[0]) - b[1]) ** 2).mean(), opt)
        step = _compose(name, base, os.path.join(tmp, f"swap{rank}"))
        state = step.init(model)
        lrs = []
        for k in range(steps):
            g = torch.Generator().manual_seed(100 * k + rank)
            batch = (torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g))
            state, m = step(state, [batch, batch] if name == "accumulate" else batch)
            assert isinstance(m["lr"], float) and not m["skipped"]
            lrs.append(m["lr"])
        state.close()
    return {"lrs": lrs}


COMPOSITIONS = ["zero3", "zero1+offload_cpu", "offload_nvme", "accumulate", "bf16+clip+sgd"]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", COMPOSITIONS)
def test_each_step_reports_the_schedules_lr(name, world):
    want = [schedule()(k) for k in range(STEPS)]
    assert len(set(want)) == STEPS  # every step's lr differs: a count off by one would show
    for r in workers(world).run(reported_lrs, name, STEPS):
        assert r["lrs"] == want


def test_a_constant_lr_is_reported():
    model = _model()
    step = zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), optim.adamw(3e-4))
    state = step.init(model)
    for _ in range(2):
        state, m = step(state, torch.ones(2, 4))
        assert m["lr"] == 3e-4


def test_an_optimizer_that_does_not_say_reports_none():
    """An optimizer of the plain protocol (not fusing, no ``lr`` field) cannot tell its lr."""
    inner = optim.sgd(0.1)
    plain = optim.Optimizer(inner.init, lambda g, s, p: inner.update(g, s, p))
    model = _model()
    step = zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), plain)
    state, m = step(step.init(model), torch.ones(2, 4))
    assert m["lr"] is None


def test_the_first_recorded_lr_is_reported_and_the_count_is_found_inside_wrappers():
    from zfunc.optim.base import GradInfo
    from zfunc.optim.reported_lr import applied_lr, next_lr, update_count

    assert applied_lr(GradInfo(lrs=[0.2, 0.1])) == 0.2  # several updates (param groups): the first's
    assert applied_lr(GradInfo()) is None
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(schedule()))
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update({"w": torch.ones(3)}, state, params)
    wrapped = {"outer": (optim.EmptyState(), state)}  # as a transform's own state holds the inner one
    assert update_count(wrapped) == 3 and next_lr(opt, wrapped) == schedule()(3)
    assert update_count(optim.EmptyState()) is None and next_lr(opt, {}) is None


# ------------------------------------------------------------------ skipped steps


def skipped_run(stage: int, script: list[bool]) -> list[tuple[bool, float]]:
    """fp16 with a loss scaler; a step whose entry in ``script`` is True overflows on rank 0."""
    model = _model()
    rank = zf.dist.rank()

    def loss_fn(params, b):
        x, poison = b
        return ((zf.apply(model, params, x)) ** 2).mean() * poison

    base = zf.train_step(loss_fn, optim.adamw(schedule()))
    step = zf.mixed_precision(base, torch.float16, loss_scale=zf.LossScaler(init_scale=4.0, hysteresis=1))
    step = zf.zero3(step) if stage == 3 else zf.zero1(step)
    state = step.init(model)
    out = []
    for k, bad in enumerate(script):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(k + 10 * rank))
        state, m = step(state, (x, float("inf") if bad and rank == 0 else 1.0))
        out.append((m["skipped"], m["lr"]))
    return out


@pytest.mark.parametrize("world,stage", [(1, 1), (2, 3), (3, 1)])
def test_a_skipped_step_reports_the_lr_the_next_update_uses(world, stage):
    script = [False, True, True, False, False, True, False]
    want, applied = [], 0
    for bad in script:
        want.append((bad, schedule()(applied)))  # the schedule's count: updates applied before
        applied += not bad
    for r in workers(world).run(skipped_run, stage, script):
        assert r == want


# ------------------------------------------------------------------------ the engine


def _engine_config(stage: int, gas: int, scheduler: dict, extra: dict | None = None) -> dict:
    return {"train_batch_size": 6 * gas, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 4e-3}},
            "scheduler": scheduler, "zero_optimization": {"stage": stage}, **(extra or {})}


WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_min_lr": 1e-4,
                                                    "warmup_max_lr": 4e-3, "warmup_num_steps": 3,
                                                    "warmup_type": "linear"}}


def engine_lrs(stage: int, gas: int, steps: int, extra: dict | None) -> dict:
    model = _model()
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, _engine_config(stage, gas, WARMUP_DECAY, extra),
                           loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())

    def data():
        k = 0
        while True:
            g = torch.Generator().manual_seed(1000 * k + rank)
            yield torch.randn(6 // world, 4, generator=g), torch.randn(6 // world, 2, generator=g)
            k += 1

    it, out = data(), []
    for _ in range(steps):
        engine.train_batch(it)
        m = engine.last_metrics
        out.append((m["skipped"], m["lr"], engine.get_lr()[0]))
    engine.close()
    return {"steps": out}


@pytest.mark.parametrize("world,stage,gas", [(1, 3, 2), (2, 3, 2), (3, 1, 1)])
def test_the_engine_reports_its_schedules_lr(world, stage, gas):
    """Each update (one per accumulation boundary) reports the config's schedule at the update count;
    ``get_lr()`` then gives the next one's."""
    sched = optim.lr.from_config(WARMUP_DECAY, 4e-3)
    for r in workers(world).run(engine_lrs, stage, gas, 6, None):
        assert r["steps"] == [(False, sched(k), sched(k + 1)) for k in range(6)]


def test_the_engine_under_fp16_counts_only_applied_updates():
    """An initial loss scale of 2**19 overflows fp16: DeepSpeed skips those steps without stepping its
    scheduler; the reported lr and ``get_lr()`` follow the applied updates."""
    sched = optim.lr.from_config(WARMUP_DECAY, 4e-3)
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 19, "hysteresis": 1}}
    (r,) = workers(1).run(engine_lrs, 2, 1, 8, fp16)
    applied, want = 0, []
    for skipped, _, _ in r["steps"]:
        want.append((skipped, sched(applied), sched(applied + (not skipped))))
        applied += not skipped
    assert r["steps"] == want
    assert 0 < applied < 8  # both kinds of step happened


def pipeline_lrs(stages: int, steps: int) -> list:
    from pipelines import config, micro_batch, pipe

    engine = zf.initialize(pipe(stages), config(2, scheduler=WARMUP_DECAY))
    out = []
    for i in range(steps):
        engine.train_batch(iter([micro_batch(i, m, engine.grid.replica) for m in range(2)]))
        out.append((engine.last_metrics["lr"], engine.get_lr()[0]))
    return out


@pytest.mark.parametrize("stages", [2, 3])
def test_every_pipeline_stage_reports_its_schedules_lr(stages):
    sched = optim.lr.from_config(WARMUP_DECAY, 4e-3)
    for r in workers(stages).run(pipeline_lrs, stages, 4):
        assert r == [(sched(k), sched(k + 1)) for k in range(4)]
