"""zf.accumulate: n micro-batches, one update, equal to one step on their concatenation;
gradients stay sharded under zero2/3; stage 0/1 reduce once; compositions and their errors."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zfunc as zf
from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from cases import micro_batches, reference, reference_mixed, run_composed
from models import DEEP_MLP as MLP, batch, build, local
from workers import workers



@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.slow), "deep_mlp", "reusing", "checkpointed", "external"])
def test_equals_one_step_on_the_concatenation(name, world):
    """Also for units used several times a micro-batch (blocks applied thrice, a tied head),
    recomputed in backward (activation checkpointing), or read outside their module."""
    kw = MLP if name == "deep_mlp" else {}
    expected = reference(name, kw, steps=3, batch_size=4 * world)
    for stage in (0, 1, 2, 3):
        for r in workers(world).run(run_composed, name, kw, stage, 3, 4, 0, None, 4):
            assert_close_to(r["params"], expected["params"])
            assert [h["loss"] for h in r["history"]] == pytest.approx(expected["losses"], rel=1e-5)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_bytes_stay_sharded(stage, world):
    """fp32 accumulators in the gradients' home form: a shard under zero2/3, whole under 0/1."""
    for r in workers(world).run(run_composed, "deep_mlp", MLP, stage, 1, 4, 0, {"dtype": torch.bfloat16}, 2):
        psi = sum(padded for _, _, padded in r["units"])
        assert r["history"][-1]["grad_bytes"] == 4 * psi / (world if stage >= 2 else 1)


def count_reductions(stage: int, micro: int) -> dict:
    """Collectives issued for gradients in one step of accumulate(zeroN(...), micro)."""
    from zfunc import dist

    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build("deep_mlp", 0, **MLP)
    shape_model = build("deep_mlp", 0, **MLP)
    calls = {"all_reduce": 0, "reduce_scatter": 0}
    originals = dist.all_reduce_mean_start, dist.reduce_scatter_mean_start

    def counted(kind, fn):
        def run(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return run

    step = {0: lambda s: s, 1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](zf.accumulate(
        zf.train_step(lambda p, b: torch.nn.functional.mse_loss(zf.apply(model, p, b[0]), b[1]), zf.optim.adamw(1e-3)),
        micro))
    state = step.init(model)
    b = local(batch("deep_mlp", shape_model, 0, 4 * world), rank, world)
    dist.all_reduce_mean_start = counted("all_reduce", originals[0])
    dist.reduce_scatter_mean_start = counted("reduce_scatter", originals[1])
    try:
        step(state, micro_batches(b, micro))
    finally:
        dist.all_reduce_mean_start, dist.reduce_scatter_mean_start = originals
    return calls | {"units": len(state.params.leaves)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_0_1_reduce_once_and_2_3_every_micro_batch(stage):
    for r in workers(2).run(count_reductions, stage, 4):
        if stage <= 1:  # DDP's no_sync: one all-reduce per unit, in the last micro-batch
            assert r == {"all_reduce": r["units"], "reduce_scatter": 0, "units": r["units"]}
        else:
            assert r == {"all_reduce": 0, "reduce_scatter": 4 * r["units"], "units": r["units"]}


def test_both_orders_with_mixed_precision_and_an_eval_step():
    """accumulate inside or outside mixed_precision is the same step; an eval step composed
    the same way reads the state and averages its micro-batches' losses."""
    kw = MLP
    init = reference("deep_mlp", kw, steps=0)["params"]
    ref = reference_mixed("deep_mlp", kw, torch.bfloat16, 3, 8, sgd=True)
    runs = [workers(2).run(run_composed, "deep_mlp", kw, 3, 3, 4, 0, {"dtype": torch.bfloat16}, 2, None, outside,
                           None, True) for outside in (False, True)]
    assert runs[0][0]["composition"] == "zero3(mixed_precision(accumulate(train_step, 2), bfloat16))"
    assert runs[1][0]["composition"] == "zero3(accumulate(mixed_precision(train_step, bfloat16), 2))"
    for r0, r1 in zip(*runs):
        assert_close_to(r0["params"], r1["params"])
        assert_within_roundoff(r0["params"], ref["params"], init, UNIT_ROUNDOFF[torch.bfloat16], sgd=True)


def test_orders_that_make_no_sense_say_which_to_write():
    step = zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)))
    with pytest.raises(ValueError, match=r"write zero3\(accumulate\(f, 4\)\)"):
        zf.accumulate(step, 4)
    with pytest.raises(ValueError, match=r"write zero3\(mixed_precision\(f, dtype\)\)"):
        zf.mixed_precision(step)
    base = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="already applied"):
        zf.accumulate(zf.accumulate(base, 2), 2)
    with pytest.raises(ValueError, match="already applied"):
        zf.mixed_precision(zf.mixed_precision(base))
    with pytest.raises(ValueError, match="needs a loss scale"):
        zf.mixed_precision(base, torch.float16)
    with pytest.raises(ValueError, match="n must be an int"):
        zf.accumulate(base, 0)


def test_a_batch_of_the_wrong_length_is_named():
    model = build("deep_mlp", 0, **MLP)
    step = zf.accumulate(zf.train_step(lambda p, b: zf.apply(model, p, b[0]).sum(), zf.optim.adamw(1e-3)), 3)
    state = step.init(model)
    b = batch("deep_mlp", build("deep_mlp", 0, **MLP), 0, 4)
    with pytest.raises(ValueError, match="got 2 micro-batches; pass exactly 3"):
        step(state, micro_batches(b, 2))
    with pytest.raises(ValueError, match="the iterator gave only 2"):
        step(state, iter(micro_batches(b, 2)))


@st.composite
def compositions(draw):
    return {
        "stage": draw(st.integers(0, 3)),
        "world": draw(st.sampled_from([1, 2, 3])),
        "dtype": draw(st.sampled_from([None, torch.bfloat16, torch.float16])),
        "micro": draw(st.sampled_from([None, 1, 2, 4])),
        "clip": draw(st.sampled_from([None, 0.05])),
        "outside": draw(st.booleans()),
        "sgd": draw(st.booleans()),
    }


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_any_composition_matches_pytorch(c):
    """Hypothesis draws stage x precision x accumulation x clipping x optimizer: fp32 within
    1e-5 of plain PyTorch, bf16/fp16 within the dtype's bounds (test_precision)."""
    world, dtype = c["world"], c["dtype"]
    prec = None if dtype is None else {"dtype": dtype} | ({"loss_scale": 1024.0} if dtype == torch.float16 else {})
    results = workers(world).run(run_composed, "deep_mlp", MLP, c["stage"], 3, 4, 0, prec, c["micro"], c["clip"],
                                 c["outside"], None, c["sgd"])
    if dtype is None:
        from cases import LR
        model = build("deep_mlp", 0, **MLP)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR * 10) if c["sgd"] else torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
        for i in range(3):
            x, y = batch("deep_mlp", model, i, 4 * world)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if c["clip"]:
                torch.nn.utils.clip_grad_norm_(params, c["clip"])
            opt.step()
        expected = {k: v.detach() for k, v in model.named_parameters()}
        for r in results:
            assert_close_to(r["params"], expected)
    else:
        init = reference("deep_mlp", MLP, steps=0)["params"]
        ref = reference_mixed("deep_mlp", MLP, dtype, 3, 4 * world, loss_scale=1024.0 if dtype == torch.float16 else 1.0,
                              clip=c["clip"], sgd=c["sgd"])
        for r in results:
            assert_within_roundoff(r["params"], ref["params"], init, UNIT_ROUNDOFF[dtype], c["sgd"])
