"""The coordinator (zfunc.coordinator): record the order, then prefetch and release along it.

Each claim of the issue is checked against plain PyTorch (results) and against the
coordinator's own accounting (``metrics["prefetch"]``, ``peak_materialized_bytes``).
"""
import time
import warnings

import pytest

import zfunc as zf
from assertions import assert_close_to
from cases import _setup, reference, run_zfunc
from models import batch, local
from workers import workers

ON_DEMAND = {"prefetch_bucket_size": 0}


def run_counting_warnings(name: str, kw: dict, steps: int, skips, prefetch=None) -> dict:
    """``run_zfunc`` under zero3, with the order warnings this rank saw."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run_zfunc(name, kw, 3, steps, 2, skips=skips, prefetch=prefetch)
    r["order_warnings"] = [str(w.message) for w in caught if issubclass(w.category, zf.OrderChangedWarning)]
    return r


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["gpt", "checkpointed", "external"])
def test_static_model_prefetches_everything_after_the_recording_step(name, world):
    """After step 0 every materialization (forward and backward re-gathers) was issued ahead:
    no misses; results equal plain PyTorch with prefetch and without."""
    expected = reference(name, {}, steps=4, batch_size=2 * world)
    for r in workers(world).run(run_zfunc, name, {}, 3, 4, 2):
        assert_close_to(r["params"], expected["params"])
        first, *later = r["prefetch"]
        assert first["hits"] == 0 and first["misses"] > 0  # recording: on demand
        for m in later:
            assert m["misses"] == 0 and m["hits"] == first["misses"] and m["bytes_prefetched"] > 0
    for r in workers(world).run(run_zfunc, name, {}, 3, 4, 2, 0, None, 0, None, "zero3", True, None, False,
                                ON_DEMAND):
        assert_close_to(r["params"], expected["params"])
        # nothing is issued ahead; a hit is only a unit used again right after (reuse distance 0)
        assert all(m["bytes_prefetched"] == 0 for m in r["prefetch"])
        assert all(m["misses"] == r["prefetch"][0]["misses"] - m["hits"] for m in r["prefetch"][1:])


@pytest.mark.parametrize("world", [2, 3])
def test_a_path_that_changes_warns_once_per_new_order(world):
    """Skipping a block on odd steps: two orders, one warning (for the second), equal results."""
    skips = [None, 1, None, 1, None, 1]
    kw = {"depth": 3}
    expected = reference("skipping", kw, steps=6, batch_size=2 * world, skips=skips)
    for r in workers(world).run(run_counting_warnings, "skipping", kw, 6, skips):
        assert_close_to(r["params"], expected["params"])
        assert len(r["order_warnings"]) == 1, r["order_warnings"]
        assert "not seen before" in r["order_warnings"][0]
        # step 2 expects step 1's order again and misses where it departs; from step 3 on each
        # order is expected from the one before it (they alternate): no misses
        assert r["prefetch"][2]["misses"] == 1, r["prefetch"]
        assert all(m["misses"] == 0 for m in r["prefetch"][3:]), r["prefetch"]


@pytest.mark.parametrize("world", [2])
def test_reuse_distance_keeps_a_unit_between_uses_or_releases_it(world):
    """Two blocks applied alternately three times: with a reuse distance above a block's size
    each stays gathered between its uses (one materialization a pass, both alive at once);
    with 0 each use gathers again and at most one block is alive besides the root."""
    expected = reference("reusing", {}, steps=3, batch_size=2 * world)
    near = dict(ON_DEMAND, max_reuse_distance=10**6)
    far = dict(ON_DEMAND, max_reuse_distance=0)
    kept = workers(world).run(run_zfunc, "reusing", {}, 3, 3, 2, 0, None, 0, None, "zero3", True, None, False, near)
    released = workers(world).run(run_zfunc, "reusing", {}, 3, 3, 2, 0, None, 0, None, "zero3", True, None, False,
                                  far)
    for k, r in zip(kept, released):
        assert_close_to(k["params"], expected["params"])
        assert_close_to(r["params"], expected["params"])
        sizes = {unit: 4 * padded for unit, _, padded in k["units"]}
        root, block = sizes.pop(""), max(sizes.values())
        # the recording step has no trace yet, so both runs gather the same there
        assert k["prefetch"][0]["misses"] == r["prefetch"][0]["misses"]
        for m_kept, m_released in zip(k["prefetch"][1:], r["prefetch"][1:]):
            assert m_kept["misses"] == len(k["units"])  # each unit gathered once a step, every other use a hit
            # the root once, 6 block uses in forward, 5 re-gathers in backward (the block forward
            # used last is kept for backward): every one gathered on demand
            assert m_released["misses"] == 1 + 6 + 5 and m_released["hits"] == 0
        assert k["peak"] >= root + 2 * block  # both blocks alive at once
        assert r["peak"] <= root + block + block // 2 < k["peak"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_budget_bounds_prefetch_and_is_reported(world):
    """A budget of one block: the coordinator prefetches what fits and never exceeds it."""
    [probe, *_] = workers(world).run(run_zfunc, "gpt", {}, 3, 3, 2)
    sizes = {unit: padded for unit, _, padded in probe["units"]}
    budget = sizes.pop("") + max(sizes.values()) + 1
    for r in workers(world).run(run_zfunc, "gpt", {}, 3, 3, 2, 0, None, 0, None, "zero3", True, None, False,
                                {"max_live_parameters": budget}):
        assert all(0 < m["max_live_elements"] <= budget for m in r["prefetch"])
        assert r["peak"] <= 4 * budget


def diverge(skip_of_rank: list, at_step: int, timeout: float) -> dict:
    """Train a residual MLP whose rank r skips block ``skip_of_rank[r]`` at ``at_step``."""
    rank, world, model, shape_model, loss_fn = _setup("skipping", {"depth": 4}, 0)
    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), collective_timeout=timeout)
    state = step.init(model)
    for i in range(at_step + 1):
        model.skip = skip_of_rank[rank] if i == at_step else None
        start = time.monotonic()  # this step's own time: the machine's load before it is not the step's
        try:
            state, _ = step(state, local(batch("skipping", shape_model, i, 2 * world), rank, world))
        except zf.RanksDivergedError as e:
            return {"step": i, "error": str(e), "seconds": time.monotonic() - start}
    return {"step": None}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("at_step", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", ["same_count", "one_rank_skips"])
def test_divergent_ranks_raise_on_every_rank_naming_the_units(world, at_step, how):
    """Ranks that run different blocks: every rank raises within the timeout, naming the first
    materialization where the orders differ and each rank's unit there (at the recording step,
    and after a trace is recorded, when the others prefetch along it)."""
    skips = list(range(1, world + 1)) if how == "same_count" else [1] + [None] * (world - 1)
    timeout = 3.0
    try:
        results = workers(world).run(diverge, skips, at_step, timeout)
    finally:
        workers(world).restart()  # a timed-out collective leaves the process group unusable
    for rank, r in enumerate(results):
        assert r["step"] == at_step, r
        # bounded by the configured timeout, timed inside the rank: the step that diverged waits
        # at most one collective timeout, then agrees on the error (a second, bounded exchange);
        # the machine's load elsewhere in the run (workers starting, other tests) is not counted
        assert r["seconds"] < 3 * timeout, r
        assert "ranks materialized different units" in r["error"]
        for other in range(world):
            assert f"rank {other}: " in r["error"]
        if how == "same_count" and at_step == 0:
            # materialization 3: <root>, blocks.0, then blocks.2 on rank 0 and blocks.1 on the others
            assert "rank 0: 'blocks.2'" in r["error"] and "rank 1: 'blocks.1'" in r["error"], r["error"]
        else:
            assert "'blocks." in r["error"], r["error"]
