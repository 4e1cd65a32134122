"""zfunc.optim.lr: the learning-rate schedules, against torch.optim.lr_scheduler's and DeepSpeed
0.19's (written out by hand, then the ``deepspeed`` package itself)."""
import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from deepspeed_oracle import real_deepspeed
from zfunc import optim
from zfunc.optim import lr as ls


# ------------------------------------------------------------ against torch.optim


def torch_lrs(make_sched, n, base_lr):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = make_sched(opt)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def assert_schedule_close(ours, theirs):
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), f"step {k}: {a} vs {b}"


@pytest.mark.parametrize("begin", [0, 3])
def test_linear_schedule_matches_linear_lr(begin):
    ours = optim.linear_schedule(0.3, 0.05, transition_steps=10, transition_begin=begin)
    ref = torch_lrs(lambda o: LinearLR(o, start_factor=0.3, end_factor=0.05, total_iters=10), 20, 1.0)
    assert_schedule_close([ours(k) for k in range(20)], [ref[0]] * begin + ref[: 20 - begin])


def test_linear_warmup_matches_linear_lr():
    ours = optim.linear_warmup(0.1, warmup_steps=5, init_value=0.01)
    ref = torch_lrs(lambda o: LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=5), 12, 0.1)
    assert_schedule_close([ours(k) for k in range(12)], ref)
    assert optim.linear_warmup(0.1, 4)(0) == 0.0
    assert optim.linear_warmup(0.1, 0)(0) == 0.1


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_cosine_decay_matches_cosine_annealing(alpha):
    ours = optim.cosine_decay(0.2, decay_steps=15, alpha=alpha)
    ref = torch_lrs(lambda o: CosineAnnealingLR(o, T_max=15, eta_min=0.2 * alpha), 16, 0.2)
    assert_schedule_close([ours(k) for k in range(16)], ref)
    assert math.isclose(ours(100), 0.2 * alpha)


def test_warmup_cosine_decay_matches_sequential_lr():
    ours = optim.warmup_cosine_decay(0.001, 0.1, warmup_steps=4, decay_steps=14, end_value=0.002)
    ref = torch_lrs(
        lambda o: SequentialLR(o, [
            LinearLR(o, start_factor=0.01, end_factor=1.0, total_iters=4),
            CosineAnnealingLR(o, T_max=10, eta_min=0.002),
        ], milestones=[4]),
        15, 0.1,
    )
    assert_schedule_close([ours(k) for k in range(15)], ref)
    assert math.isclose(ours(1000), 0.002)


def test_constant():
    assert [optim.constant(0.5)(k) for k in (0, 1, 10**6)] == [0.5, 0.5, 0.5]


# ----------------------------------------------------------- DeepSpeed's, by hand

LOG4 = math.log(4)


@pytest.mark.parametrize("kind, expect", [
    # update: 0 (DeepSpeed's iteration -1), 1 (it 0), 2, 3 (mid), 4 (it 3: end of a 4-step warmup), 5, 100
    ("linear", [0.1, 0.1, 0.1 + 0.9 / 4, 0.1 + 0.9 * 2 / 4, 0.1 + 0.9 * 3 / 4, 1.0, 1.0]),
    ("log", [0.1, 0.1, 0.1 + 0.9 * math.log(2) / LOG4, 0.1 + 0.9 * math.log(3) / LOG4, 1.0, 1.0, 1.0]),
])
def test_warmup_lr_by_hand(kind, expect):
    s = ls.warmup_lr(warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type=kind)
    assert [s(k) for k in (0, 1, 2, 3, 4, 5, 100)] == pytest.approx(expect, rel=1e-12)


def test_warmup_lr_defaults_are_deepspeeds():
    s = ls.warmup_lr()  # min 0, max 1e-3, 1000 steps, log
    assert s(0) == s(1) == 0.0
    assert s(501) == pytest.approx(1e-3 * math.log(501) / math.log(1000))
    assert s(1000) == pytest.approx(1e-3) and s(10**6) == pytest.approx(1e-3)


def test_a_one_step_warmup_is_stretched_to_two_as_in_deepspeed():
    s = ls.warmup_lr(0.0, 1.0, warmup_num_steps=1, warmup_type="linear")
    assert [s(k) for k in range(4)] == [0.0, 0.0, 0.5, 1.0]


@pytest.mark.parametrize("kind, warm", [
    ("linear", [0.1, 0.1, 0.1 + 0.9 / 3, 0.1 + 0.9 * 2 / 3]),
    ("log", [0.1, 0.1, 0.1 + 0.9 * math.log(2) / math.log(3), 1.0]),
])
def test_warmup_decay_lr_by_hand(kind, warm):
    # warmup 3, total 7: iteration it >= 3 has gamma (7 - it) / (7 - 3), floored at 0
    s = ls.warmup_decay_lr(total_num_steps=7, warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=3,
                           warmup_type=kind)
    decay = [0.1 + 0.9 * g for g in (1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0)]  # updates 4..10: end at 8, past it
    assert [s(k) for k in range(11)] == pytest.approx(warm + decay, rel=1e-12)
    assert s(10**6) == pytest.approx(0.1)


@pytest.mark.parametrize("kind, warm", [
    ("linear", [0.0, 0.5 * 0.1, 0.5 * (0.1 + 0.9 / 3), 0.5 * (0.1 + 0.9 * 2 / 3)]),
    ("log", [0.0, 0.5 * 0.1, 0.5 * (0.1 + 0.9 * math.log(2) / math.log(3)), 0.5]),
])
def test_warmup_cosine_lr_by_hand(kind, warm):
    s = ls.warmup_cosine_lr(total_num_steps=7, warmup_min_ratio=0.1, warmup_num_steps=3, cos_min_ratio=0.01,
                            warmup_type=kind, base_lr=0.5)

    def cos(progress):
        return 0.5 * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress)))

    decay = [cos(1 / 4), cos(2 / 4), cos(3 / 4), cos(1.0), 0.5 * 0.01, 0.5 * 0.01]  # updates 4..9
    assert [s(k) for k in range(10)] == pytest.approx(warm + decay, rel=1e-12)
    assert s(10**6) == pytest.approx(0.005)


@pytest.mark.parametrize("build, key", [
    (lambda: ls.warmup_lr(warmup_num_steps=-1), "warmup_num_steps"),
    (lambda: ls.warmup_lr(warmup_num_steps=2.5), "warmup_num_steps"),
    (lambda: ls.warmup_lr(warmup_type="exp"), "warmup_type"),
    (lambda: ls.warmup_lr(warmup_min_lr=-0.1), "warmup_min_lr"),
    (lambda: ls.warmup_lr(warmup_max_lr=True), "warmup_max_lr"),
    (lambda: ls.warmup_decay_lr(total_num_steps=-3), "total_num_steps"),
    (lambda: ls.warmup_decay_lr(total_num_steps=1000), "total_num_steps"),
    (lambda: ls.warmup_decay_lr(total_num_steps=500, warmup_num_steps=600), "total_num_steps"),
    (lambda: ls.warmup_cosine_lr(total_num_steps=10, warmup_num_steps=10, base_lr=1.0), "total_num_steps"),
    (lambda: ls.warmup_cosine_lr(100, warmup_num_steps=10, cos_min_ratio=-1, base_lr=1.0), "cos_min_ratio"),
    (lambda: ls.warmup_cosine_lr(100, warmup_num_steps=10, base_lr=-1.0), "base_lr"),
])
def test_bad_schedule_values_name_the_key(build, key):
    with pytest.raises(ValueError, match=key):
        build()


def test_from_config_builds_each_type():
    warm = ls.from_config({"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}, 0.5)
    assert warm(11) == 0.5  # no warmup_max_lr: the optimizer's lr, as DeepSpeed 0.19 does
    decay = ls.from_config({"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_num_steps": 10}}, 0.5)
    assert decay(11) == pytest.approx(0.001)  # WarmupDecayLR keeps its own default max of 1e-3
    cos = ls.from_config({"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 10}}, 0.5)
    assert cos(0) == 0.0 and cos(10**6) == pytest.approx(0.5 * 1e-4)
    same = ls.from_config({"type": "WarmupLR", "params": {"last_batch_iteration": -1}}, 1e-3)
    assert [same(k) for k in range(0, 3000, 7)] == [ls.warmup_lr()(k) for k in range(0, 3000, 7)]


def test_from_config_errors_name_the_place():
    with pytest.raises(ValueError,
                       match=r"unknown key 'scheduler.params.warmup_max_lrr': did you mean 'warmup_max_lr'"):
        ls.from_config({"type": "WarmupLR", "params": {"warmup_max_lrr": 1.0}}, 1e-3)
    with pytest.raises(ValueError, match=r"did you mean 'WarmupDecayLR'\?.*WarmupLR, WarmupDecayLR, WarmupCosineLR"):
        ls.from_config({"type": "WarmupDecay"}, 1e-3)
    for name in ("OneCycle", "LRRangeTest"):
        with pytest.raises(ValueError, match=f"{name}.*not supported yet"):
            ls.from_config({"type": name}, 1e-3)


def test_a_schedule_drives_a_zfunc_optimizer_like_deepspeed():
    from zfunc import optim

    schedule = ls.warmup_lr(0.0, 1.0, warmup_num_steps=4, warmup_type="linear")
    opt = optim.sgd(schedule)
    p = {"w": torch.zeros(1, dtype=torch.float64)}
    state = opt.init(p)
    for k in range(6):
        p, state = opt.update({"w": torch.ones(1, dtype=torch.float64)}, state, p)
        assert p["w"].item() == pytest.approx(-sum(schedule(i) for i in range(k + 1)))
    assert [schedule(i) for i in range(6)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]


# ------------------------------------------------------- against DeepSpeed itself


def _ds_lrs(cls, steps, lr, **kw):
    """The lr DeepSpeed's scheduler gives each of ``steps`` updates: built on the
    optimizer, ``step()`` after each optimizer step, as its engine does."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = cls(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("warmup, total", [(1, 5), (2, 3), (5, 12), (10, 40)])
def test_schedules_match_deepspeeds_classes(kind, warmup, total):
    real_deepspeed()
    from deepspeed.runtime import lr_schedules as dsl

    n = total + 10
    cases = [
        (dsl.WarmupLR, dict(warmup_min_lr=0.01, warmup_max_lr=0.3), "WarmupLR"),
        (dsl.WarmupLR, dict(), "WarmupLR"),  # warmup_max_lr from the optimizer's lr
        (dsl.WarmupDecayLR, dict(total_num_steps=total, warmup_min_lr=0.01, warmup_max_lr=0.3), "WarmupDecayLR"),
        (dsl.WarmupDecayLR, dict(total_num_steps=total), "WarmupDecayLR"),
        (dsl.WarmupCosineLR, dict(total_num_steps=total, warmup_min_ratio=0.2, cos_min_ratio=0.05), "WarmupCosineLR"),
        (dsl.WarmupCosineLR, dict(total_num_steps=total), "WarmupCosineLR"),
    ]
    for cls, params, name in cases:
        params = dict(params, warmup_num_steps=warmup, warmup_type=kind)
        ours = ls.from_config({"type": name, "params": params}, 0.7)
        theirs = _ds_lrs(cls, n, 0.7, **params)
        assert [ours(k) for k in range(n)] == pytest.approx(theirs, rel=1e-12, abs=0), (name, params)
