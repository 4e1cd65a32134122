"""A checkpoint loads into another composition (zfunc.checkpoint): any ZeRO stage, offload and
precision, at any world size, holding the same numbers.

Oracles: the numbers themselves (the target, saved again right after the load, holds the
checkpoint's fp32 weights, its parameters cast to its own dtype, and the same moments and
counters, whatever the stage, offload or world size), and plain PyTorch trained without
interruption (fp32 targets of fp32 checkpoints continue training as if never stopped, 1e-5).
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zfunc as zf
from cases import _setup, compose, reference
from models import batch, local
from test_zero_equivalence import assert_close_to
from workers import workers

GLOBAL_BATCH = 6  # divides over W = 1, 2, 3
BEFORE, AFTER = 1, 2  # steps before the save, and after the load


def _valid(stage: int, offload, bf16: bool) -> bool:
    return offload != "nvme" or stage in (0, 3)  # zero1/2 keep whole parameters, which nvme cannot hold


COMPOSITIONS = [(stage, offload, bf16) for stage in (0, 1, 2, 3) for offload in (None, "cpu", "nvme")
                for bf16 in (False, True) if _valid(stage, offload, bf16)]


def _step(composition, loss_fn, swap_dir):
    stage, offload, bf16 = composition
    kw = None if offload is None else {"kind": offload}
    if offload == "nvme":
        kw["path"] = swap_dir
    return compose(stage, loss_fn, precision={"dtype": torch.bfloat16} if bf16 else None, offload=kw)


def train_then_save(composition, directory: str) -> None:
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    step = _step(composition, loss_fn, os.path.join(directory, "swap-src"))
    state = step.init(model)
    for i in range(BEFORE):
        state, _ = step(state, local(batch("gpt", shape_model, i, GLOBAL_BATCH), rank, world))
    zf.checkpoint.save(state, os.path.join(directory, "src"), "t")
    state.close()


def load_resave_train(composition, directory: str) -> dict:
    """Load the checkpoint, save what was loaded (in this composition, at this world size), train on."""
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    step = _step(composition, loss_fn, os.path.join(directory, f"swap-tgt-w{world}"))
    state, manifest = zf.checkpoint.load(step.init(model), os.path.join(directory, "src"))
    zf.checkpoint.save(state, os.path.join(directory, f"tgt-w{world}"), "t")
    for i in range(BEFORE, BEFORE + AFTER):
        state, _ = step(state, local(batch("gpt", shape_model, i, GLOBAL_BATCH), rank, world))
    out = {"params": zf.gather_params(state), "count": int(state.count)}
    state.close()
    return out


def _assert_same_numbers(source: str, target: str) -> None:
    """Every part of the target checkpoint holds the source's numbers (in the target's dtype)."""
    src = zf.checkpoint.Saved(zf.checkpoint.resolve(source))
    tgt = zf.checkpoint.Saved(zf.checkpoint.resolve(target))
    fp32 = "master" if "master" in src.layouts else "params"  # the checkpoint's full-precision weights
    for role, units in tgt.layouts.items():
        if units == "tensor":
            assert torch.equal(tgt.tensor(role), src.tensor(role).to(tgt.tensor(role).dtype)), role
            continue
        for i, unit in enumerate(units):
            if unit is None or (unit["numel"] == 0 and tgt.files[0].entry(f"{role}#{i}")["shape"]):
                continue  # an empty unit
            expected = src.unit(fp32 if role in ("params", "master") else role, i)
            got = tgt.unit(role, i)
            assert got.dtype == (torch.bfloat16 if role == "params" and "master" in tgt.layouts else expected.dtype)
            assert torch.equal(got, expected.to(got.dtype)), (role, i)


def _check(source, w_source, target, w_target, tmp_path) -> None:
    directory = str(tmp_path)
    workers(w_source).run(train_then_save, source, directory)
    results = workers(w_target).run(load_resave_train, target, directory)
    _assert_same_numbers(os.path.join(directory, "src"), os.path.join(directory, f"tgt-w{w_target}"))
    if not source[2] and not target[2]:  # fp32 both: training goes on as if never stopped
        expected = reference("gpt", {}, steps=BEFORE + AFTER, batch_size=GLOBAL_BATCH)
        for r in results:
            assert r["count"] == BEFORE + AFTER
            assert_close_to(r["params"], expected["params"])


@pytest.mark.parametrize("source,w_source,target,w_target", [
    ((2, None, False), 2, (3, "nvme", False), 3),  # zero2 -> zero3(offload_nvme(...)), W 2 -> 3
    ((3, None, True), 2, (0, None, False), 1),  # bf16 master weights -> the fp32 parameters of a plain step
    ((1, None, False), 2, (3, "cpu", True), 3),  # fp32 parameters -> master weights, parameters cast
    ((3, "nvme", True), 3, (2, None, True), 2),
])
def test_a_checkpoint_loads_into_another_composition(source, w_source, target, w_target, tmp_path):
    _check(source, w_source, target, w_target, tmp_path)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(COMPOSITIONS), w_source=st.integers(1, 3), target=st.sampled_from(COMPOSITIONS),
       w_target=st.integers(1, 3))
def test_any_checkpoint_loads_into_any_composition(source, w_source, target, w_target, tmp_path_factory):
    _check(source, w_source, target, w_target, tmp_path_factory.mktemp("ckpt"))


def test_a_checkpoint_of_another_optimizer_is_a_clear_error(tmp_path):
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    adamw = zf.zero2(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    zf.checkpoint.save(adamw.init(model, free_model=False), str(tmp_path), "t")
    sgd = zf.zero3(zf.train_step(loss_fn, zf.optim.sgd(1e-3, momentum=0.9)))
    with pytest.raises(ValueError, match=r"here only: \['opt_state.momentum'\]; in the checkpoint only: "
                       r"\['opt_state.mu', 'opt_state.nu'\]\): it was saved with another optimizer"):
        zf.checkpoint.load(sgd.init(model), str(tmp_path))
