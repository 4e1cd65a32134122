"""offload_cpu(delay=1): ZeRO-Offload's delayed parameter update, equal to its plain PyTorch
reference (tests/harness/delayed_reference.py: ``torch.optim.AdamW`` applying each gradient one
step late) in fp32 within 1e-5, at every stage, W = 1 and 2, with accumulation, clipping on the
delayed gradient, fp16 overflow (a skipped step stays skipped), the update behind the next step on
the worker thread (``overlap``) or not, and across a checkpoint's save, load and resume. Its exact
branch (``delay_after``) is ``delay=0`` bit for bit, and a delayed update that fails refuses the state."""
import importlib
import os
import tempfile
import threading

import pytest
import torch

import zfunc as zf
from cases import run_composed
from delayed_reference import delayed_reference
from models import SeededNet, batch, build, local, loss
from workers import workers

GPT = {}
CPU = {"kind": "cpu", "copy_grads_on_host": True}
TOL = 1e-5


def _run(stage, steps, offload, per_rank=4, precision=None, micro=None, clip=None, inject=None):
    return run_composed("gpt", GPT, stage, steps, per_rank, 0, precision, micro, clip, False, None, False, inject,
                        offload=offload, peek=False)


def _close(got: dict, want: dict, tol: float = TOL) -> None:
    assert got.keys() == want.keys()
    for k in want:
        diff = (got[k].float() - want[k].float()).abs().max().item()
        assert diff <= tol, f"{k}: {diff}"


def _check(results, ref, delayed_from: int, steps: int, key: str = "params", tol: float = TOL,
           loss_rel: float = TOL) -> None:
    """``loss_rel``: the losses' tolerance relative to their size (an fp16 loss is rounded to 2^-10
    of it, per rank at W > 1, on the global batch in the reference)."""
    for r in results:
        _close(r["params"], ref[key], tol)
        losses = [h["loss"] for h in r["history"]]
        assert all(abs(a - b) <= loss_rel * abs(b) for a, b in zip(losses, ref["losses"])), (losses, ref["losses"])
        flags = [h["offload"]["delayed"] for h in r["history"] if not h["skipped"]]
        updates = sum(not s for s in ref["skipped"])
        assert flags == [i >= delayed_from for i in range(updates)]


def test_delayed_equals_its_reference():
    """Fast sibling: W = 1, zero3, fp32, one exact update then delayed; the delay shows (the exact
    run differs)."""
    steps = 4
    (r,) = workers(1).run(_run, 3, steps, {**CPU, "delay": 1, "delay_after": 1})
    ref = delayed_reference("gpt", GPT, steps, 4, delay_after=1)
    _check([r], ref, 1, steps)
    exact = delayed_reference("gpt", GPT, steps, 4, delay_after=steps)
    assert any(not torch.allclose(r["params"][k], exact["params"][k], atol=1e-4) for k in exact["params"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_delayed_equals_its_reference_at_every_stage(world, stage):
    """Accumulated micro-batches, clipping on the delayed gradient (by its own norm), overlap on
    and off, from the first update and after two exact ones."""
    steps = 5
    for delay_after in (0, 2):
        ref = delayed_reference("gpt", GPT, steps, 4 * world, delay_after=delay_after, clip=0.05)
        for overlap in (False, True):
            off = {**CPU, "delay": 1, "delay_after": delay_after, "overlap": overlap}
            _check(workers(world).run(_run, stage, steps, off, 4, None, 2, 0.05), ref, delay_after, steps)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_an_overflowing_gradient_is_never_applied(world):
    """fp16 at a fixed scale of 1024, an inf injected at steps 1 and 3: those steps are skipped
    whole and the pending update stays pending. The fp32 master holds the pending update too
    (``ahead``); its tolerance is fp16's forward, not fp32's."""
    steps, inject = 6, [(), (0,), (), (0,), (), ()]
    ref = delayed_reference("gpt", GPT, steps, 4 * world, overflow=(1, 3), dtype=torch.float16, loss_scale=1024.0)
    precision = {"dtype": torch.float16, "loss_scale": 1024.0}
    for overlap in (False, True):
        off = {**CPU, "delay": 1, "overlap": overlap}
        results = workers(world).run(_run, 3, steps, off, 4, precision, None, None, inject)
        for r in results:
            assert [h["skipped"] for h in r["history"]] == ref["skipped"]
        _check(results, ref, 0, steps, key="ahead", tol=2e-3, loss_rel=2e-3)


@pytest.mark.slow
def test_the_loss_scale_follows_each_steps_own_gradient():
    """Dynamic fp16 scaling: the scale, and which steps it skips, are those of the exact update
    (the scaler reads the gradient the step took, delayed or not)."""
    steps, inject = 6, [(), (0,), (0,), (), (), ()]
    precision = {"dtype": torch.float16, "loss_scale": "dynamic"}
    (exact,) = workers(1).run(_run, 3, steps, CPU, 4, precision, None, None, inject)
    (late,) = workers(1).run(_run, 3, steps, {**CPU, "delay": 1}, 4, precision, None, None, inject)
    for key in ("loss_scale", "skipped"):
        assert [h[key] for h in late["history"]] == [h[key] for h in exact["history"]]
    assert sum(h["skipped"] for h in late["history"]) >= 1


@pytest.mark.slow
def test_the_exact_branch_is_delay_0_bit_for_bit():
    """``delay_after`` past the last step: every update takes the delayed state's exact branch,
    bit for bit the exact update (bf16, clipped, accumulated; overlap on and off)."""
    opts = dict(precision={"dtype": torch.bfloat16}, micro=2, clip=0.5)
    for overlap in (False, True):
        (plain,) = workers(1).run(_run, 3, 4, {**CPU, "overlap": overlap}, 4, *opts.values())
        (late,) = workers(1).run(_run, 3, 4, {**CPU, "overlap": overlap, "delay": 1, "delay_after": 4}, 4,
                                 *opts.values())
        for k in plain["params"]:
            assert torch.equal(plain["params"][k], late["params"][k]), k
        assert [h["loss"] for h in plain["history"]] == [h["loss"] for h in late["history"]]


def resumed(world_dir: str, stage: int, steps: int, cut: int, overlap: bool) -> dict:
    """``steps`` delayed steps, the state saved after ``cut`` of them, loaded into a fresh one and
    run on: the losses and parameters of the resumed run, and of the uninterrupted one."""
    rank, world = zf.dist.rank(), zf.dist.world_size()

    def make():
        model = build("gpt", 0)
        twin = build("gpt", 0)

        def loss_fn(params, b):
            return loss("gpt", zf.apply(model, params, b[0]), b[1])

        step = zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.01))
        step = zf.offload_cpu(zf.mixed_precision(step, dtype=torch.bfloat16), copy_grads_on_host=True,
                              overlap=overlap, delay=1, delay_after=1)
        step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step)
        return step, step.init(model), twin

    def run(step, state, twin, lo, hi):
        losses = []
        for i in range(lo, hi):
            state, m = step(state, local(batch("gpt", twin, i, 4 * world), rank, world))
            losses.append(m["loss"].item())
        return state, losses

    step, state, twin = make()
    state, whole = run(step, state, twin, 0, steps)
    want = {k: v.clone() for k, v in zf.gather_params(state).items()}
    behind = [t.clone() for t in state.params.leaves]
    step, state, twin = make()
    state, first = run(step, state, twin, 0, cut)
    zf.checkpoint.save(state, world_dir, "cut")
    step, fresh, twin = make()
    fresh, _ = zf.checkpoint.load(fresh, world_dir, "cut")
    fresh, rest = run(step, fresh, twin, cut, steps)
    return {"whole": whole, "resumed": first + rest, "want": want, "got": zf.gather_params(fresh),
            "behind": all(torch.equal(a, b) for a, b in zip(behind, fresh.params.leaves))}


@pytest.mark.parametrize("world, stage, overlap", [
    (1, 3, False), pytest.param(2, 2, True, marks=pytest.mark.slow), pytest.param(2, 3, True, marks=pytest.mark.slow)])
def test_a_checkpoint_keeps_the_pending_update(world, stage, overlap):
    """Saved after 3 steps (one exact, two delayed: an update pending), loaded and run to 6: equal to
    the uninterrupted run, bit for bit (bf16 parameters behind, fp32 master ahead)."""
    with tempfile.TemporaryDirectory() as d:
        for r in workers(world).run(resumed, os.path.join(d, "ckpt"), stage, 6, 3, overlap):
            assert r["resumed"] == r["whole"]
            for k in r["want"]:
                assert torch.equal(r["got"][k], r["want"][k]), k
            assert r["behind"]


class _Release(torch.autograd.Function):
    """Identity on the loss; its backward sets ``gate`` (when given)."""

    @staticmethod
    def forward(value, gate):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.gate = inputs[1]

    @staticmethod
    def backward(ctx, g):
        if ctx.gate is not None:
            ctx.gate.set()
        return g, None


def _net_step(gate: dict, overlap: bool = True):
    """zero3(offload_cpu(delay=1, overlap=True)) of a small net whose backward sets ``gate["event"]``
    (if set), and its batch."""
    model = SeededNet()

    def loss_fn(params, b):
        value = torch.nn.functional.mse_loss(zf.apply(model, params, b[0]), b[1])
        return _Release.apply(value, gate.get("event"))

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), units=lambda name, m: isinstance(m, torch.nn.Sequential))
    step = zf.zero3(zf.offload_cpu(step, copy_grads_on_host=True, overlap=overlap, delay=1, rates=zf.Rates(1e9)))
    return step, step.init(model), (torch.randn(8, 6), torch.randn(8, 2))


def _kernels(monkeypatch, fn):
    """The host Adam's kernels replaced by ``fn(original, *args, **kw)``."""
    adam = importlib.import_module("zfunc.ops.adam")
    for owner, name in ((adam.cpu_adam, "fused_update_"), (adam, "torch_adam_")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _o=original, **k: fn(_o, *a, **k))


def test_the_delayed_update_runs_behind_the_next_forward_and_backward(monkeypatch):
    """Step 2's host update is held until step 3's backward runs: step 2 returns, and step 3's
    forward and backward run without it (had either waited, the held update would time out and
    the state refuse); step 3's update then waits for it."""
    gate = {}
    torch.manual_seed(0)
    step, state, b = _net_step(gate)
    state, _ = step(state, b)
    state.opt_state.ahead.leaves
    released = threading.Event()

    def held(original, *a, **k):
        assert released.wait(30), "the next step's backward never ran while this update was held"
        return original(*a, **k)

    _kernels(monkeypatch, held)
    state, m2 = step(state, b)  # returns with its update held
    gate["event"] = released
    state, m3 = step(state, b)  # its backward releases step 2's update
    assert released.is_set() and m2["offload"]["delayed"] and m3["offload"]["delayed"]
    monkeypatch.undo()
    torch.manual_seed(0)
    plain, again, _ = _net_step({}, overlap=False)
    for _ in range(3):
        again, _ = plain(again, b)
    for got, want in zip(state.opt_state.ahead.leaves + state.params.leaves,
                         again.opt_state.ahead.leaves + again.params.leaves):
        assert torch.equal(got, want)  # the held update read step 2's gradients, not step 3's


def test_a_delayed_update_that_fails_refuses_the_state(monkeypatch):
    """The update behind the next step breaks: the state it returned, and the next, refuse."""
    step, state, b = _net_step({})
    state, _ = step(state, b)
    state.opt_state.ahead.leaves  # the first update is over before the kernel breaks

    def broken(original, *a, **k):
        raise RuntimeError("the host Adam failed")

    _kernels(monkeypatch, broken)
    state, metrics = step(state, b)  # the update is behind: the step itself returns
    assert metrics["offload"]["delayed"]
    with pytest.raises(zf.UpdateFailed if hasattr(zf, "UpdateFailed") else RuntimeError,
                       match="the host Adam failed|optimizer update"):
        step(state, b)
    with pytest.raises(RuntimeError):
        state.params.leaves


@pytest.mark.parametrize("kw, match", [
    (dict(delay=2), "not later"), (dict(delay=-1), "whole number"), (dict(delay=1, delay_after=1.5), "whole number"),
    (dict(delay=1, params=True), "params=True"), (dict(delay=1, ratio=0.5), "plan=/ratio=/budget=")])
def test_bad_delays_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        zf.offload_cpu(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), **kw)
