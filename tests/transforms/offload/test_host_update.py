"""offload_cpu(overlap=True): the host's share of each update run unit by unit on a worker thread,
behind the next step's forward (zfunc.transforms.offload.host_update).

The GPU path runs here with CPU tensors standing in for device ones (host copies are clones) and
uploads that land late: a unit's device buffer holds NaN until a reader waits for its upload. So a
forward that read a unit before its update and upload were done would train on NaN. Checked: bit
for bit the synchronous update, with and without clipping, fp16 overflow, accumulation, bf16, a
split update, SGD, the parameter tier, W = 1, 2, 3 at every stage; the step returns before the
host update has run; the next forward waits for each unit when it first uses it, one at a time;
an error in the host update reaches whoever reads the state next."""
import importlib
import threading
import time

import pytest
import torch

import zfunc as zf
from cases import run_composed
from models import DEEP_MLP as MLP, SeededNet
from workers import workers

oc = importlib.import_module("zfunc.transforms.offload.cpu")
host_update = importlib.import_module("zfunc.transforms.offload.host_update")
placement = importlib.import_module("zfunc.placement")

CPU = {"kind": "cpu", "copy_grads_on_host": True}


class LateUploads(host_update.Uploads):
    """Uploads that land only when a reader waits: until then the device buffer holds NaN."""

    log: list = []
    gate: threading.Event | None = None  # set: copies wait for it (the update stays in flight)

    def __init__(self, pin):
        super().__init__(False)

    def copy(self, dst, src):
        if LateUploads.gate is not None:
            assert LateUploads.gate.wait(60), "the test never let the host update go on"
        mark = (dst, src.clone())
        dst.fill_(float("nan"))
        return mark

    def wait(self, mark):
        dst, value = mark
        if not torch.equal(dst, value):
            LateUploads.log.append(("landed", dst.data_ptr()))
            dst.copy_(value)


def _clone(t, pin=False):
    return t.clone() if isinstance(t, torch.Tensor) else t


def stand_in_device():
    """offload_cpu sees every tensor as off the CPU: host copies are clones, updated values go back
    through ``LateUploads``. Returns a function that undoes it."""
    saved = oc._off_cpu, oc.to_host, oc._uploads
    oc._off_cpu, oc.to_host, oc._uploads = (lambda tree: True), _clone, LateUploads
    LateUploads.log = []

    def undo():
        oc._off_cpu, oc.to_host, oc._uploads = saved
    return undo


def late_run(args: tuple, offload: dict, stand_in: bool = True) -> dict:
    """``run_composed(*args)`` under ``offload``, the state left alone between steps, with the GPU
    path stood in (``stand_in_device``)."""
    undo = stand_in_device() if stand_in else (lambda: None)
    try:
        return run_composed(*args, offload=offload, peek=False) | {"landed": len(LateUploads.log)}
    finally:
        undo()


def _same(a, b):
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    assert [h.get("skipped") for h in a["history"]] == [h.get("skipped") for h in b["history"]]


CASES = {
    "fp32": dict(),
    "clipped": dict(clip=0.05),
    "bf16": dict(precision={"dtype": torch.bfloat16}),
    "fp16 overflow": dict(precision={"dtype": torch.float16, "loss_scale": "dynamic"}, inject=[(), (0,), (), ()]),
    "accumulated": dict(micro=3, clip=0.5),
    "split": dict(offload={"ratio": 0.5}, precision={"dtype": torch.bfloat16}),
    "sgd": dict(sgd={"momentum": 0.9, "weight_decay": 0.01}),
}


def _args(name="gpt", kw=None, stage=3, steps=4, precision=None, micro=None, clip=None, sgd=False, inject=None):
    return (name, {} if kw is None else kw, stage, steps, 4, 0, precision, micro, clip, False, None, sgd, inject)


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_equals_the_synchronous_update_with_late_copies(case):
    opts = dict(CASES[case])
    extra = opts.pop("offload", {})
    args = _args(**opts)
    (plain,) = workers(1).run(late_run, args, {**CPU, **extra, "overlap": False}, False)
    (late,) = workers(1).run(late_run, args, {**CPU, **extra, "overlap": True})
    _same(plain, late)
    assert late["landed"] > 0  # the uploads ran, and were waited for
    if case == "fp16 overflow":
        skipped = [h["skipped"] for h in late["history"]]
        assert skipped[1] and not all(skipped)  # the injected overflow skipped, others updated


@pytest.mark.parametrize("world, stages", [(2, (1, 2, 3)), (3, (0, 3))])
def test_overlapped_equals_the_synchronous_update_across_ranks(world, stages):
    for stage in stages:
        for opts in (dict(precision={"dtype": torch.bfloat16}, clip=0.5), dict(micro=2)):
            args = _args(stage=stage, **opts)
            plain = workers(world).run(late_run, args, {**CPU, "overlap": False}, False)
            late = workers(world).run(late_run, args, {**CPU, "overlap": True})
            for a, b in zip(plain, late):
                _same(a, b)


@pytest.mark.parametrize("world", [1, 2])
def test_the_parameter_tier_overlapped_equals_it_synchronous(world):
    """``params=True``: the worker updates the host shards in place; the next forward's copy of
    each shard to the device waits for that unit's update."""
    args = _args("deep_mlp", MLP, precision={"dtype": torch.bfloat16}, clip=0.5)
    tier = {**CPU, "params": True}
    plain = workers(world).run(late_run, args, {**tier, "overlap": False}, False)
    overlapped = workers(world).run(late_run, args, {**tier, "overlap": True}, False)
    for a, b in zip(plain, overlapped):
        _same(a, b)


def _step():
    model = SeededNet()

    def loss_fn(params, b):
        return torch.nn.functional.mse_loss(zf.apply(model, params, b[0]), b[1])

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), units=lambda name, m: isinstance(m, torch.nn.Sequential))
    return zf.zero3(zf.offload_cpu(step, copy_grads_on_host=True, overlap=True)), model


def test_the_step_returns_first_and_the_next_forward_waits_unit_by_unit(monkeypatch):
    undo = stand_in_device()
    start = placement.materialize_start

    def logged(place, leaf, *a, **k):
        LateUploads.log.append(("use", leaf.data_ptr()))
        return start(place, leaf, *a, **k)

    monkeypatch.setattr(placement, "materialize_start", logged)
    try:
        step, model = _step()
        state = step.init(model)
        b = (torch.randn(8, 6), torch.randn(8, 2))
        state, _ = step(state, b)
        state.params.leaves  # the first update is over (reading waits for it)
        LateUploads.gate = threading.Event()
        state, _ = step(state, b)  # returns with the host update held at its first upload
        updates = next(t for t in step.transforms if t.name == "offload_cpu").overlap
        assert updates._last and not any(f.done() for f in updates._last)
        LateUploads.gate.set()
        LateUploads.log.clear()
        state, _ = step(state, b)  # its forward waits for each unit as it first uses it
        log = list(LateUploads.log)
        units = [t.data_ptr() for t in state.params.leaves]
    finally:
        LateUploads.gate = None
        undo()
    assert sorted(p for kind, p in log if kind == "landed") == sorted(units)  # each unit's upload, once
    for unit in units:  # lands as its first use starts, not all before the forward does
        assert log.index(("landed", unit)) == log.index(("use", unit)) + 1, log
    assert [kind for kind, _ in log[:4]] == ["use", "landed", "use", "landed"]


def test_an_error_in_the_host_update_reaches_the_next_reader(monkeypatch):
    step, model = _step()
    state = step.init(model)
    b = (torch.randn(8, 6), torch.randn(8, 2))
    state, _ = step(state, b)
    state.params.leaves  # the first update is over before the kernel breaks
    adam = importlib.import_module("zfunc.ops.adam")

    def broken(*a, **k):
        raise RuntimeError("the host Adam failed")

    monkeypatch.setattr(adam.cpu_adam, "fused_update_", broken)
    monkeypatch.setattr(adam, "torch_adam_", broken)
    state, _ = step(state, b)  # the update is behind: the step itself returns
    with pytest.raises(RuntimeError, match="the host Adam failed"):
        state.params.leaves


def host_sums_run(args: tuple, offload: dict) -> dict:
    """``run_composed(*args)`` under ``offload`` with every reduced gradient standing in for a device
    one (``host_sums``: copies down are clones, counted) and the host adds late (a reader that did not
    wait for them would see part of a sum)."""
    host_sums = importlib.import_module("zfunc.transforms.offload.host_sums")
    saved = host_sums._on_device, host_sums.to_host, host_sums._add_landed
    copies = []
    host_sums._on_device = lambda t: True
    host_sums.to_host = lambda t, pin: copies.append(t.numel()) or t.clone()
    host_sums._add_landed = lambda *a: time.sleep(0.003) or saved[2](*a)
    try:
        return run_composed(*args, offload=offload, peek=False) | {"copied": len(copies)}
    finally:
        host_sums._on_device, host_sums.to_host, host_sums._add_landed = saved


@pytest.mark.parametrize("world, stage", [(1, 3), (2, 2), (3, 3)])
def test_sums_kept_on_the_host_equal_sums_kept_on_the_device(world, stage):
    """``accumulate_on="host"``: each micro-batch's reduced shard goes down and is added into a
    host sum by the worker (once per unit, micro-batch and step), nothing sent home in the last
    backward; bit for bit the sums kept on the device."""
    args = _args(stage=stage, steps=3, micro=3, precision={"dtype": torch.bfloat16}, clip=0.5)
    device = workers(world).run(host_sums_run, args, {**CPU, "overlap": False})
    host = workers(world).run(host_sums_run, args, {**CPU, "overlap": False, "accumulate_on": "host"})
    for a, b in zip(device, host):
        _same(a, b)
        units = len(b["units"])
        assert b["copied"] == 3 * 3 * units  # steps x micro-batches x units, each shard once
        assert a["copied"] == 3 * units  # on the device: each unit's sum once, in the last backward


def test_sums_on_the_host_refuse_the_update_behind_the_next_forward():
    """On an H200 (run 5) the pair differed from the synchronous update, cause not found: refused,
    and left unset the update runs after backward."""
    step = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="overlap=True cannot be combined with accumulate_on='host'"):
        zf.offload_cpu(step, accumulate_on="host", overlap=True)
    assert zf.offload_cpu(step, accumulate_on="host").transforms[-1].overlap is None


def test_accumulate_on_must_say_where():
    with pytest.raises(ValueError, match="accumulate_on must be 'device' or 'host'"):
        zf.offload_cpu(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), accumulate_on="gpu")


def test_overlap_follows_where_the_state_computes(monkeypatch):
    """Left unset, overlap is on for a machine with CUDA, but a state that computes on the CPU runs
    its update in the step (there the worker would share the step's own cores); given True, it runs
    on the worker wherever the state computes."""
    from zfunc.transforms.offload.host_update import UnitUpdates

    started = []
    real_start = UnitUpdates.start
    monkeypatch.setattr(UnitUpdates, "start", lambda self, *a, **k: started.append(1) or real_start(self, *a, **k))
    def steps(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

        def loss_fn(params, batch):
            return zf.apply(model, params, batch[0]).pow(2).mean()

        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)  # a machine with CUDA, when the step is made
            step = zf.zero3(zf.offload_cpu(zf.train_step(loss_fn, zf.optim.adamw(1e-2)), **kw))
        assert next(t for t in step.transforms if t.family == "offload").overlap is not None  # on, as on CUDA
        state = step.init(model)
        for i in range(2):
            state, _ = step(state, (torch.randn(3, 4),))
        return zf.gather_params(state)

    unset = steps()
    assert started == []  # the CPU state's update ran in the step
    given = steps(overlap=True)
    assert len(started) == 2
    assert all(torch.equal(unset[k], given[k]) for k in unset)
