"""Bad input gets a clear error naming what is wrong (docs/architecture.md, composition rules)."""
import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from models import build


def _step(model, transform=zf.zero3, **kw):
    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(zf.apply(model, params, x), y)

    return transform(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), **kw)


def test_batch_that_does_not_fit_the_model():
    model = build("no_list")
    step = _step(model)
    state = step.init(model)
    with pytest.raises(RuntimeError, match=r"(?s)batch of \[\(4, 5\) float32, \(4, 2\) float32\].*matches what the model expects"):
        step(state, (torch.randn(4, 5), torch.randn(4, 2)))


def test_unit_policy_naming_a_missing_module():
    model = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1)
    with pytest.raises(ValueError, match=r"'block\.1'.*Did you mean 'blocks\.1'"):
        _step(model, units=["block.1"]).init(model)


def test_state_from_another_model():
    a, b = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1), build("deep_mlp", d_in=3, width=4, depth=3, d_out=1)
    state_a = _step(a).init(a)
    with pytest.raises(ValueError, match=r"different model.*blocks\.2"):
        _step(b)(state_a, (torch.randn(2, 3), torch.randn(2, 1)))


def test_state_from_another_shape_of_the_same_model():
    a, b = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1), build("deep_mlp", d_in=3, width=5, depth=2, d_out=1)
    state_a = _step(a).init(a)
    with pytest.raises(ValueError, match=r"different model: parameter 'inp.weight' has shape \(5, 3\)"):
        _step(b)(state_a, (torch.randn(2, 3), torch.randn(2, 1)))


def test_state_from_a_step_of_another_stage():
    model = build("no_list")
    state = _step(model, zf.zero1).init(model)
    with pytest.raises(ValueError, match=r"built by zero1\(train_step\) at world size 1, but this step is zero3\(train_step\)"):
        _step(model)(state, (torch.randn(2, 3), torch.randn(2, 2)))


def test_model_whose_storage_was_taken():
    model = build("no_list")
    _step(model).init(model)
    with pytest.raises(ValueError, match="held by a zfunc State.*Step.init"):
        _step(model).init(model)


def test_zero_applied_twice():
    model = build("no_list")
    with pytest.raises(ValueError, match="already ZeRO stage 1"):
        zf.zero3(_step(model, zf.zero1))


def test_mixed_dtypes_in_one_unit():
    model = build("no_list")
    model.net[0].bias.data = model.net[0].bias.data.double()
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        _step(model).init(model)


def test_loss_must_be_a_scalar():
    model = build("no_list")
    step = zf.train_step(lambda p, b: zf.apply(model, p, b[0]), zf.optim.adamw(1e-3))
    state = step.init(model)
    with pytest.raises(TypeError, match="scalar"):
        step(state, (torch.randn(2, 3), None))


def _batch():
    return torch.randn(4, 3), torch.randn(4, 2)


def test_donated_state_passed_again():
    model = build("no_list")
    step = _step(model)
    state = step.init(model)
    new, _ = step(state, _batch())
    with pytest.raises(ValueError, match="donated to a step.*use the state that step returned"):
        step(state, _batch())
    step(new, _batch())


def test_world_size_in_the_environment_without_a_process_group(monkeypatch):
    model = build("no_list")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .* no process group.*zf.dist.init\(\)"):
        _step(model).init(model)


@pytest.mark.parametrize("transform", [zf.zero1, zf.zero3])
def test_nonfinite_gradient_raises_naming_step_and_unit_and_keeps_the_state(transform):
    model = build("deep_mlp", d_in=3, width=4, depth=2, d_out=2)
    step = _step(model, transform)
    state, _ = step(step.init(model), (torch.randn(4, 3), torch.randn(4, 2)))
    before = [t.clone() for t in zf.pytree.tree_leaves(state)]
    x = torch.randn(4, 3)
    x[1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"step 1: non-finite gradient .* unit '<root>'.*not updated"):
        step(state, (x, torch.randn(4, 2)))
    zf.testing.assert_trees_all_equal(zf.pytree.tree_leaves(state), before)
    state, metrics = step(state, _batch())  # the state is still usable
    assert not metrics["skipped"]


def test_nonfinite_gradient_skips_when_asked():
    model = build("no_list")

    def loss_fn(params, batch):
        return F.mse_loss(zf.apply(model, params, batch[0]), batch[1])

    step = zf.zero2(zf.train_step(loss_fn, zf.optim.adamw(1e-3), nonfinite="skip"))
    state = step.init(model)
    before = [t.clone() for t in zf.pytree.tree_leaves(state.params)] + [t.clone() for t in zf.pytree.tree_leaves(state.opt_state)]
    x = torch.randn(4, 3)
    x[0, 0] = float("inf")
    state, metrics = step(state, (x, torch.randn(4, 2)))
    assert metrics["skipped"] and int(state.count) == 1
    zf.testing.assert_trees_all_equal([*zf.pytree.tree_leaves(state.params), *zf.pytree.tree_leaves(state.opt_state)], before)
    state, metrics = step(state, _batch())
    assert not metrics["skipped"] and int(state.opt_state.count) == 1


@pytest.mark.parametrize("error", [
    torch.distributed.DistBackendError("Connection closed by peer"),
    torch.OutOfMemoryError("out of memory"),
    RuntimeError("something else broke"),
])
def test_only_shape_errors_blame_the_batch(error):
    model = build("no_list")

    def loss_fn(params, batch):
        raise error

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(model)
    with pytest.raises(type(error)) as info:
        step(state, _batch())
    assert "check the batch" not in str(info.value).lower() and "matches what the model" not in str(info.value)
    if isinstance(error, torch.distributed.DistError):
        assert "another rank probably failed first" in "".join(info.value.__notes__)


def test_using_the_model_outside_apply_says_how():
    model = build("no_list")
    _step(model).init(model)
    with pytest.raises(RuntimeError, match=r"'net.0.weight' is held by a zfunc State.*zf.apply"):
        model(torch.randn(2, 3))


def test_composition_rules():
    model = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1)
    base = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))
    assert zf.zero3(zf.units(base, ["blocks.0"])).composition == "zero3(units(train_step, ['blocks.0']))"
    with pytest.raises(ValueError, match=r"already has units \['blocks.0'\].*not also \['blocks.1'\]"):
        zf.zero3(zf.units(base, ["blocks.0"]), units=["blocks.1"])
    with pytest.raises(TypeError, match="zero2 transforms a zfunc Step"):
        zf.zero2(lambda s, b: s)
    assert zf.zero3(zf.units(base, ["blocks.0"]), units=["blocks.0"]).units == ["blocks.0"]


def test_clip_reduces_on_the_leaves_device():
    """The whole-model norm is accumulated on the gradients' own device (the group's),
    so a nccl group never has to reduce a CPU scalar; the CUDA run is below."""
    model = build("no_list")
    state = _step(model).init(model)
    assert state.params.sum_of_squares().device == state.params.leaves[0].device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and nccl")
def test_clip_under_nccl_on_cuda(tmp_path):
    import torch.distributed as tdist
    tdist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = build("no_list").cuda()

        def loss_fn(params, batch):
            return F.mse_loss(zf.apply(model, params, batch[0]), batch[1])

        step = zf.zero3(zf.train_step(loss_fn, zf.optim.chain(zf.optim.clip_by_global_norm(0.1), zf.optim.adamw(1e-3))))
        state = step.init(model)
        state, metrics = step(state, (torch.randn(4, 3, device="cuda"), torch.randn(4, 2, device="cuda")))
        assert state.params.sum_of_squares().is_cuda and torch.isfinite(metrics["loss"])
    finally:
        tdist.destroy_process_group()


# ------------------------------------------------- a rank that stops or dies mid-training


def _serve_once(rank: int, world: int, store: str, results, fn, args) -> None:
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results.put((rank, fn(rank, world, *args)))


def _launch(fn, world: int, *args, answers: int, limit_s: float = 240.0) -> dict:
    """``fn(rank, world, *args)`` in ``world`` fresh gloo processes (the shared workers cannot
    outlive a rank that is stopped or killed); the first ``answers`` results by rank; every
    process is killed after."""
    import multiprocessing as mp
    import queue
    import tempfile

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mktemp(prefix="zfunc-gloo-")
    procs = [ctx.Process(target=_serve_once, args=(r, world, store, results, fn, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < answers:
            try:
                rank, value = results.get(timeout=limit_s)
            except queue.Empty:
                raise AssertionError(f"only ranks {sorted(out)} answered in {limit_s:g} s") from None
            out[rank] = value
    finally:
        for p in procs:
            p.kill()  # a stopped process dies too
            p.join()
    return out


def _last_rank_stops(rank: int, world: int, how: str, timeout: float):
    """Two good steps, then the last rank stops (SIGSTOP: a stuck data loader) or dies (SIGKILL)
    before its third; the others' third step raises."""
    import os
    import signal
    import time

    model = build("deep_mlp", d_in=3, width=8, depth=3, d_out=2)
    step = _step(model, zf.zero3, collective_timeout=timeout)
    state = step.init(model)
    for _ in range(2):
        state, _ = step(state, _batch())
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
    start = time.monotonic()
    try:
        step(state, _batch())
    except Exception as e:  # noqa: BLE001 - the test names the type it expects
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "", time.monotonic() - start


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", [pytest.param("stopped", marks=pytest.mark.slow), "killed"])
def test_a_rank_that_stops_or_dies_is_named_within_the_timeout(how, world):
    """The ranks that wait raise RankUnresponsiveError naming the missing rank as stuck or dead,
    within the collective timeout (a killed rank at once: its connections reset), not a
    divergence of the units the ranks materialized."""
    timeout = 4.0
    answers = _launch(_last_rank_stops, world, how, timeout, answers=world - 1)
    for rank, (kind, message, seconds) in answers.items():
        assert kind == "RankUnresponsiveError", (rank, kind, message)
        assert f"rank {world - 1} did not arrive" in message and "stuck" in message and "dead" in message, message
        assert "materialized different units" not in message
        assert seconds < timeout + 1.5, (rank, seconds)
        if how == "killed":
            assert "collective failed" in message, message
    assert issubclass(zf.coordinator.RankUnresponsiveError, zf.RanksDivergedError)
