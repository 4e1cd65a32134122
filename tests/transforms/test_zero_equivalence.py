"""zero1/2/3 at W = 1, 2, 3 equal plain PyTorch on the global batch (docs/testing.md)."""
import pytest

from assertions import RTOL, assert_close_to
from cases import gathers_in_flight, loss_with_uneven_batches, nonfinite_on_rank0, reference, run_ddp, run_zfunc
from workers import workers
from zfunc.testing import assert_trees_all_close

MODELS = {
    "gpt": {},
    "odd_mlp": {},
    "no_list": {},
    "cross_tied": {},
}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_stages_match_pytorch(name, world):
    expected = reference(name, MODELS[name], steps=3, batch_size=2 * world)
    for stage in (0, 1, 2, 3):
        results = workers(world).run(run_zfunc, name, MODELS[name], stage, 3, 2)
        for r in results:
            assert_close_to(r["params"], expected["params"])
            assert r["losses"] == pytest.approx(expected["losses"], rel=RTOL)
            assert r["eval_loss"] == pytest.approx(expected["eval_loss"], rel=RTOL)


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_and_batchnorm_match_ddp(world):
    """BatchNorm uses per-rank statistics, as under DDP; frozen weights never move."""
    for stage in (0, 1, 2, 3):
        ddp = workers(world).run(run_ddp, "frozen_bn", {}, 3, 4)
        ours = workers(world).run(run_zfunc, "frozen_bn", {}, stage, 3, 4)
        for d, o in zip(ddp, ours):
            assert_close_to(o["params"], d["params"])
            assert_close_to(o["buffers"], {k: v.float() for k, v in d["buffers"].items()} | {})


def test_frozen_single_process_matches_pytorch():
    expected = reference("frozen_bn", {}, steps=3, batch_size=4)
    for stage in (0, 1, 2, 3):
        [r] = workers(1).run(run_zfunc, "frozen_bn", {}, stage, 3, 4)
        assert_close_to(r["params"], expected["params"])
        assert r["memory"]["frozen_bytes"] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_clip_by_global_norm_covers_sharded_gradients(world):
    expected = reference("gpt", {}, steps=3, batch_size=2 * world, clip=0.05)
    for stage in (1, 2, 3):
        for r in workers(world).run(run_zfunc, "gpt", {}, stage, 3, 2, 0, None, 0, 0.05):
            assert_close_to(r["params"], expected["params"])


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_2_gathers_finish_before_anyone_reads(stage):
    """The post-update all-gathers are left running when the step returns
    (the next forward overlaps them); flattening the params waits for all."""
    results = workers(2).run(gathers_in_flight, "odd_mlp", stage)
    for r in results:
        assert r["in_flight"], "no all-gather was left to overlap the next forward"
        assert r["left"] == 0
    assert_trees_all_close(results[0]["leaves"], results[1]["leaves"], rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_nonfinite_gradient_on_one_rank_stops_every_rank(stage):
    for message in workers(2).run(nonfinite_on_rank0, stage):
        assert message.startswith("step 0: non-finite gradient")


def test_loss_metric_is_the_mean_of_the_ranks_losses():
    """With uneven batches the metric weights ranks equally, as gradients do (like DDP)."""
    results = workers(3).run(loss_with_uneven_batches, 3)
    mean = sum(r["own"] for r in results) / 3
    for r in results:
        assert r["metric"] == pytest.approx(mean, rel=1e-6)
