"""A checkpoint loads into another composition (zfunc.checkpoint): any ZeRO stage, offload and
precision, at any world size, holding the same numbers.

Oracles: the numbers themselves (the target, saved again right after the load, holds the
checkpoint's fp32 weights, its parameters cast to its own dtype, and the same moments and
counters, whatever the stage, offload or world size), and plain PyTorch trained without
interruption (fp32 targets of fp32 checkpoints continue training as if never stopped, 1e-5).
"""
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zfunc as zf
from assertions import assert_close_to
from cases import _setup, compose, reference
from checkpoints import assert_same_numbers
from models import batch, local
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


def _check(source, w_source, target, w_target, tmp_path) -> None:
    directory = str(tmp_path)
    workers(w_source).run(train_then_save, source, directory)
    results = workers(w_target).run(load_resave_train, target, directory)
    assert_same_numbers(os.path.join(directory, "src"), os.path.join(directory, f"tgt-w{w_target}"))
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


def _mlp(width: int) -> dict:
    return {"d_in": 5, "width": width, "depth": 3, "d_out": 3}


def save_deep_mlp(directory: str, width: int, stage: int, units=None) -> str:
    """deep_mlp of ``width`` after one step of zero``stage``(train_step(adamw)), saved in ``directory``."""
    rank, world, model, shape_model, loss_fn = _setup("deep_mlp", _mlp(width), 0)
    step = compose(stage, loss_fn, units=units)
    state = step.init(model)
    state, _ = step(state, local(batch("deep_mlp", shape_model, 0, GLOBAL_BATCH), rank, world))
    zf.checkpoint.save(state, directory, "t")
    return step.composition


def load_deep_mlp(directory: str, width: int, stage: int, units=None, opt: str = "adamw"):
    """Load into deep_mlp of ``width`` under zero``stage``: ``(count, None)``, or ``(None, the error)``."""
    rank, world, model, shape_model, loss_fn = _setup("deep_mlp", _mlp(width), 0)
    step = compose(stage, loss_fn, units=units, opt=zf.optim.sgd(1e-3, momentum=0.9) if opt == "sgd" else None)
    try:
        state, _ = zf.checkpoint.load(step.init(model), directory)
    except ValueError as e:
        return None, str(e)
    return int(state.count), None


MLP_UNITS = ["blocks.0", "blocks.1"]  # two units and the root, instead of one per layer


@pytest.mark.parametrize("saved,loaded,says", [
    # (world, width, stage, units), the same, what the error names besides what load would convert
    ((1, 8, 3, None), (1, 8, 3, MLP_UNITS),
     [r"grouped into other units \(another unit policy\): \d+ units in the checkpoint, \d+ here; unit \d+ is",
      r"Also different, which load would reshard or convert: transforms zero3\(train_step\) in the checkpoint, "
      r"zero3\(units\(train_step, \['blocks.0', 'blocks.1'\]\)\) here\. The same on both sides: world size 1\."]),
    ((1, 8, 3, None), (1, 12, 3, None),
     [r"saved from another model: parameter '\S+' has shape \(\d+(, \d+)?\) in the checkpoint but",
      r"The same on both sides: world size 1 and transforms zero3\(train_step\)\."]),
    ((2, 8, 2, None), (1, 12, 3, None),
     [r"has shape \(\d+(, \d+)?\) in the checkpoint but \(\d+(, \d+)?\) in this model",
      r"Also different, which load would reshard or convert: world size 2 in the checkpoint, 1 here; "
      r"transforms zero2\(train_step\) in the checkpoint, zero3\(train_step\) here\."]),
    ((2, 8, 3, MLP_UNITS), (1, 8, 3, None),
     [r"another unit policy\): 3 units in the checkpoint, 4 here; unit 0 is '<root>' holding \['inp.weight', "
      r"'inp.bias', 'blocks.2.0.weight'\] and \d+ more in the checkpoint, '<root>' holding \['inp.weight', "
      r"'inp.bias', 'out.weight'\] and \d+ more here",
      r"Also different, which load would reshard or convert: world size 2 in the checkpoint, 1 here; transforms "
      r"zero3\(units\(train_step, \['blocks.0', 'blocks.1'\]\)\) in the checkpoint, zero3\(train_step\) here\."]),
])
def test_a_checkpoint_of_another_layout_says_what_differs(saved, loaded, says, tmp_path):
    """Each mismatch is named once, with what else differs (which load would reshard) and what
    load needs; the composition is never named twice as if it were the difference."""
    directory = str(tmp_path)
    world, width, stage, units = saved
    workers(world).run(save_deep_mlp, directory, width, stage, units)
    w, width, stage, units = loaded
    for count, error in workers(w).run(load_deep_mlp, directory, width, stage, units):
        assert count is None and error.startswith(f"checkpoint {os.path.join(directory, 't')!r} cannot load")
        for pattern in says:
            assert re.search(pattern, error), (pattern, error)
        assert "load reshards what it can (any world size, ZeRO stage, offload and mixed precision)" in error


def test_another_optimizer_with_the_same_transforms_names_them_once(tmp_path):
    directory = str(tmp_path)
    composition = workers(1).run(save_deep_mlp, directory, 8, 3)[0]
    ((count, error),) = workers(1).run(load_deep_mlp, directory, 8, 3, None, "sgd")
    assert count is None and error.count(composition) == 1, error
    assert "here only: ['opt_state.momentum']; in the checkpoint only: ['opt_state.mu', 'opt_state.nu']" in error


@pytest.mark.slow
@pytest.mark.parametrize("saved,loaded", [((2, 2), (1, 3)), ((1, 3), (2, 1)), ((2, 3), (3, 3))])
def test_another_world_size_and_stage_reshard_and_load(saved, loaded, tmp_path):
    """What differs only in world size and ZeRO stage is no mismatch: load reshards it."""
    directory = str(tmp_path)
    workers(saved[0]).run(save_deep_mlp, directory, 8, saved[1])
    assert workers(loaded[0]).run(load_deep_mlp, directory, 8, loaded[1]) == [(1, None)] * loaded[0]
