"""Models as users write them (docs/architecture.md): weights read outside their module's
forward, activation checkpointing, blocks skipped by control flow, meta-device init.
Each equals plain PyTorch (torch.optim.AdamW with its defaults) on the global batch."""
import pytest

from assertions import assert_close_to
from cases import init_state, reference, run_zfunc
from workers import workers
from zfunc.testing import assert_trees_all_equal


def _check(name, world, stages=(0, 1, 2, 3), steps=3, per_rank=2, kw=None, **opts):
    kw = kw or {}
    ref_kw = {k: v for k, v in opts.items() if k in ("skips", "meta")}
    expected = reference(name, kw, steps=steps, batch_size=per_rank * world, **ref_kw)
    for stage in stages:
        for r in workers(world).run(run_zfunc, name, kw, stage, steps, per_rank, 0, None, 0, None, "zero3",
                                    opts.get("free_model", True), opts.get("skips"), opts.get("meta", False)):
            assert_close_to(r["params"], expected["params"])
            assert r["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_weights_read_outside_their_module(world):
    """A gate weight read in the root's forward, a block's norm weight as a head, the
    embedding as a functional LM head: each read materializes that unit."""
    _check("external", world)


@pytest.mark.parametrize("free_model", [True, False])
@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing(world, free_model):
    """Recomputation in backward sees the unit's current weights, re-gathered under zero3
    (with free_model=False it used to recompute on the stale initial weights)."""
    _check("checkpointed", world, free_model=free_model)


@pytest.mark.parametrize("world", [1, 2])
def test_block_skipped_by_control_flow_gets_no_update(world):
    """A block no rank used gets no update that step (no decay, moments and step count
    untouched), as torch.optim with zero_grad(set_to_none=True) leaves it."""
    _check("skipping", world, steps=4, skips=[None, 1, 1, None])


MLP = {"d_in": 3, "width": 7, "depth": 3, "d_out": 2}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["frozen_bn", "odd_mlp", "cross_tied", "checkpointed"])
def test_meta_device_init_equals_eager_init(name, world):
    """A model built on the meta device and initialized unit by unit gives the state an
    eager model with the same init gives: parameters (frozen too) and buffers, bit for bit."""
    for stage in (0, 1, 3):
        eager = workers(world).run(init_state, name, stage, False)
        meta = workers(world).run(init_state, name, stage, True)
        for e, m in zip(eager, meta):
            assert_trees_all_equal(m, e)


@pytest.mark.parametrize("world", [1, 2])
def test_meta_device_init_trains_like_pytorch(world):
    _check("deep_mlp", world, kw=MLP, meta=True)
    _check("checkpointed", world, meta=True)
