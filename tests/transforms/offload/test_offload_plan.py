"""offload_cpu's split of the update between the device and the host (``zfunc.transforms.offload.plan``):
the planner's choice on fake rates and budgets, DeepSpeed's ratio, the plan printed, saved and
passed back, the engine's ``offload_optimizer.ratio``; a split step equals the unsplit one bit for
bit on the CPU at W = 1 and 2; the roofline each offloaded step reports; the rates' cache."""
import dataclasses
import importlib
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import zfunc as zf
from cases import run_composed
from models import SeededNet
from workers import workers
from zfunc.transforms.offload import plan as offload_plan, rates
from zfunc.engine import compose as engine_compose
from zfunc.engine import config as zc
from zfunc.placement import CPU, DEVICE

FAST = zf.Rates(host_update=4.5e9, device_update=90e9, pcie=50e9, machine="fake")
UNITS = [("", 100), ("blocks.0", 50), ("blocks.1", 50), ("blocks.2", 80)]


@pytest.mark.parametrize("budget, kept", [
    (0, ()), (10**9, ("", "blocks.0", "blocks.1", "blocks.2")),
    (150 * 12, ("", "blocks.0")),  # first fit in forward order
    (1300, ("",)), (1000, ("blocks.0",)),  # the root does not fit: the next that does
])
def test_the_planner_fills_the_budget_in_forward_order(budget, kept):
    plan = offload_plan.plan_for_budget(UNITS, budget=budget, rates=FAST, state_bytes=12, copy_bytes=4)
    assert plan.device_units == kept
    assert plan.host_units == tuple(n for n, _ in UNITS if n not in kept)
    assert plan.device_bytes == 12 * sum(n for name, n in UNITS if name in kept) <= budget
    host = sum(n for name, n in UNITS if name not in kept)
    assert plan.predicted["host update"] == pytest.approx(host / FAST.host_update)
    assert plan.predicted["copies"] == pytest.approx(host * 4 / FAST.pcie)


def test_a_host_as_fast_as_the_device_keeps_the_device_free():
    slow_device = zf.Rates(host_update=5e9, device_update=5e9, pcie=50e9)
    assert offload_plan.plan_for_budget(UNITS, budget=10**9, rates=slow_device, state_bytes=12,
                                     copy_bytes=4).device_units == ()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.integers(0, 20000), st.sampled_from([8, 12, 16]))
def test_the_plan_fits_its_budget_and_no_unit_left_on_the_host_would_fit(sizes, budget, state_bytes):
    units = [(f"u{i}", n) for i, n in enumerate(sizes)]
    plan = offload_plan.plan_for_budget(units, budget=budget, rates=FAST, state_bytes=state_bytes, copy_bytes=4)
    assert plan.device_bytes <= budget
    left = budget - plan.device_bytes
    assert all(n * state_bytes > left for name, n in units if name in plan.host_units)
    assert set(plan.device_units) | set(plan.host_units) == {name for name, _ in units}


@pytest.mark.parametrize("ratio, kept", [(1.0, ()), (0.0, ("", "blocks.0", "blocks.1", "blocks.2")),
                                         (0.4, ("", "blocks.0")), (0.5, ("",)), (0.7, ())])
def test_deepspeeds_ratio_is_the_share_updated_on_the_host(ratio, kept):
    assert offload_plan.plan_for_ratio(UNITS, ratio).device_units == kept


def test_a_plan_prints_saves_and_loads(tmp_path):
    plan = offload_plan.plan_for_budget(UNITS, budget=1800, rates=FAST, state_bytes=12, copy_bytes=4)
    text = str(plan)
    assert "2 units updated on the device" in text and "2 on the host" in text and "host update" in text
    plan.save(tmp_path / "plan.json")
    back = zf.OffloadPlan.load(tmp_path / "plan.json")
    assert back == plan and back.rates == FAST and back.predicted == plan.predicted
    assert json.loads(plan.to_json())["device_units"] == ["", "blocks.0"]


def _step(precision=False, **offload):
    def loss_fn(params, b):
        return nn.functional.mse_loss(zf.apply(model_holder[0], params, b[0]).float(), b[1])

    model_holder = [None]
    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), units=lambda name, m: isinstance(m, nn.Sequential))
    if precision:
        step = zf.mixed_precision(step, torch.bfloat16)
    return zf.zero3(zf.offload_cpu(step, copy_grads_on_host=True, **offload)), model_holder


def _train(steps=3, precision=False, **offload):
    step, holder = _step(precision, **offload)
    model = holder[0] = SeededNet()
    state = step.init(model)
    g = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        b = (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g))
        state, metrics = step(state, b)
        history.append(metrics)
    return state, history


def _homes(state):
    return {u.name: p.opt_home for u, p in zip(state.params.spec.model.units, state.params.spec.placements)}


@pytest.mark.parametrize("precision", [False, True])
def test_a_split_step_equals_the_unsplit_one_bit_for_bit(precision, tmp_path):
    plain, _ = _train(precision=precision)
    names = [u.name for u in plain.params.spec.model.units]
    for offload in ({"ratio": 0.5}, {"ratio": 0.0}, {"budget": 10**9, "rates": FAST},
                    {"plan": zf.OffloadPlan(tuple(names[1:3]), tuple(names[:1] + names[3:]))}):
        split, _ = _train(precision=precision, **offload)
        homes = _homes(split)
        kept = {n for n, h in homes.items() if h == DEVICE}
        assert kept and all(h in (CPU, DEVICE) for h in homes.values()), homes
        if "plan" in offload:
            assert kept == set(offload["plan"].device_units)
        for a, b in zip(zf.gather_params(plain).values(), zf.gather_params(split).values()):
            assert torch.equal(a, b)


def test_the_planned_split_comes_back_from_a_saved_plan(tmp_path):
    step, holder = _step()
    holder[0] = SeededNet()
    # the root's (inp and out, 146 parameters) and two blocks' fp32 Adam moments fit (8 bytes a parameter), the third's not
    plan = zf.plan_offload(step, holder[0], budget=(160 + 2 * 16 * 17) * 8, rates=FAST)
    assert plan.device_units == ("", "blocks.0", "blocks.1") and plan.host_units == ("blocks.2",)
    plan.save(tmp_path / "plan.json")
    state, _ = _train(plan=str(tmp_path / "plan.json"))
    assert {n for n, h in _homes(state).items() if h == DEVICE} == set(plan.device_units)
    other = zf.OffloadPlan(("nope",), ("",))
    with pytest.raises(ValueError, match=r"made for other units.*'nope'"):
        _train(plan=other)


@pytest.mark.parametrize("world", [2])
def test_a_split_step_equals_the_unsplit_one_across_ranks(world):
    cpu = {"kind": "cpu", "copy_grads_on_host": True}
    args = ("gpt", {}, 3, 2, 4, 0, {"dtype": torch.bfloat16}, 2, 1.0)
    plain = workers(world).run(run_composed, *args, False, None, False, None, cpu)
    split = workers(world).run(run_composed, *args, False, None, False, None, {**cpu, "ratio": 0.5})
    for a, b in zip(plain, split):
        assert "offload_cpu" in b["composition"]
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


def test_every_offloaded_step_reports_its_roofline():
    state, history = _train(rates=FAST, budget=0)  # every unit updated on the host
    host_params = sum(u.trainable.padded for u in state.params.spec.model.units)
    for metrics in history:
        r = metrics["offload"]
        parts = {"compute": r["compute_s"], "host update": r["host_update_s"], "copies": r["copies_s"]}
        assert r["bound_s"] >= max(parts.values()) and r["binds"] in parts
        assert r["compute_s"] > 0 and r["update_s"] > 0 and 0 < r["achieved"]
        assert r["host_update_s"] == pytest.approx(host_params / FAST.host_update)


def test_engine_config_maps_deepspeeds_ratio():
    c = zc.parse({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "ratio": 0.25}}}, 1)
    step = engine_compose.compose(c, zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)))
    step = step[0] if isinstance(step, tuple) else step
    offload = next(t for t in step.transforms if t.name == "offload_cpu")
    assert offload.ratio == 0.25


@pytest.mark.parametrize("kw, match", [
    ({"ratio": 1.5}, "ratio must be in"), ({"ratio": 0.5, "budget": 10}, "one of plan=, ratio= and budget="),
    ({"params": True, "ratio": 0.5}, r"params=True\) keeps every parameter shard on the host"),
    ({"budget": -1}, "budget must be a number of bytes"), ({"plan": 3}, "plan must be an OffloadPlan"),
])
def test_bad_splits_are_clear_errors(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        zf.offload_cpu(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), **kw)


def test_rates_are_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ZFUNC_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(rates, "_adam_rate", lambda device, numel: calls.append(device) or 1e9)
    first = rates.measure("cpu")
    again = rates.measure("cpu")
    assert first == again and first.host_update == 1e9 and len(calls) == 1
    assert rates.machine_key(torch.device("cpu")) in json.loads((tmp_path / "rates.json").read_text())
    real = rates.measure("cpu", numel=1 << 16, cache=False)  # the real kernel, not cached
    assert len(calls) == 2 and real.host_update == 1e9 and real.pcie == float("inf")


class _FakeDevice:
    """CPU tensors standing in for device ones: ``offload_cpu`` sees the tensors in ``on_device``
    as off the CPU, and its host copies as clones it records, so the split update's GPU path (host
    copies for the host units, the kept units updated where they are) runs here."""

    def __init__(self, monkeypatch):
        import importlib
        oc = importlib.import_module("zfunc.transforms.offload.cpu")
        self.on_device, self.copied = set(), []
        monkeypatch.setattr(oc, "_off_cpu", lambda tree: any(id(t) in self.on_device for t in zf.pytree.tree_leaves(tree)))
        monkeypatch.setattr(oc, "to_host", self.to_host)

    def to_host(self, t, pin):
        if not isinstance(t, torch.Tensor) or id(t) not in self.on_device:
            return t
        self.copied.append(t)
        return t.clone()

    def put(self, params):
        for t in params.leaves:
            if t is not None:
                self.on_device.add(id(t))
        return params


def test_the_split_update_keeps_device_units_in_place_and_copies_the_rest(monkeypatch):
    """The GPU path of a split update, on the CPU: host units get host copies at init (in the
    stored dtype), their gradients go home and their updated parameters come back; kept units are
    updated in place, nothing of theirs copied; the result equals the unsplit update."""
    from zfunc.optim.base import GradInfo
    from zfunc.transforms.offload.cpu import host_optimizer
    from zfunc.transforms.precision import master_weights

    state, _ = _train(steps=0, precision=True, ratio=0.5)  # a split placement (bf16 parameters)
    homes = [p.opt_home for p in state.params.spec.placements]
    assert CPU in homes and DEVICE in homes
    fake = _FakeDevice(monkeypatch)
    params = fake.put(zf.Params(state.params.spec, [t.clone() for t in state.params.leaves]))
    master = fake.put(zf.Params(state.params.spec, [t.float() for t in state.params.leaves]))  # init: before the cast
    opt = host_optimizer(master_weights(zf.optim.adamw(1e-2)), pin=False)
    plain = master_weights(zf.optim.adamw(1e-2))
    opt_state, plain_state = opt.init(master), plain.init(master)
    host = opt_state.params
    assert [h is not None for h in host.leaves] == [h == CPU for h in homes]
    assert all(h.dtype == torch.bfloat16 for h in host.leaves if h is not None)  # the stored dtype, not fp32
    plain_params = zf.Params(params.spec, [t.clone() for t in params.leaves])
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        grads = fake.put(zf.Params(params.spec, [torch.randn(t.shape, generator=g).to(t.dtype) for t in params.leaves]))
        fake.copied.clear()
        kept = [t for t, h in zip(params.leaves, homes) if h == DEVICE]
        before = [t.clone() for t in kept]
        new, opt_state = opt.update(grads, opt_state, params, info=GradInfo())
        plain_params, plain_state = plain.update(zf.Params(grads.spec, [t.clone() for t in grads.leaves]),
                                                 plain_state, plain_params, info=GradInfo())
        assert new is params and all(not torch.equal(a, b) for a, b in zip(kept, before))  # updated in place
        copied = {id(t) for t in fake.copied}
        for t, gr, h in zip(params.leaves, grads.leaves, homes):
            assert (id(gr) in copied) == (h == CPU)  # only host units' gradients went home
            assert id(t) not in copied
        for a, b in zip(params.leaves, plain_params.leaves):
            assert torch.equal(a, b)


@pytest.mark.parametrize("offload", [{}, {"ratio": 0.5}])
def test_accumulated_sums_leave_the_device_in_the_last_backward(monkeypatch, offload):
    """Under accumulate, the last micro-batch hands each host-homed unit's sum to the host as its
    last use is reduced (CPU tensors standing in for device ones, the copies recorded): every
    host unit's sum and no kept unit's, once each; bit for bit the run without the stand-in."""
    import importlib
    host_sums = importlib.import_module("zfunc.transforms.offload.host_sums")

    def train():
        def loss_fn(params, b):
            return nn.functional.mse_loss(zf.apply(model, params, b[0]), b[1])

        model = SeededNet()
        step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), units=lambda name, m: isinstance(m, nn.Sequential))
        step = zf.zero3(zf.offload_cpu(zf.accumulate(step, 3), **offload))
        state = step.init(model)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            micro = [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
            state, _ = step(state, micro)
        return state

    plain = train()
    copied = []
    monkeypatch.setattr(host_sums, "_on_device", lambda t: True)
    monkeypatch.setattr(host_sums, "to_host", lambda t, pin: copied.append(t) or t.clone())
    stood_in = train()
    host_units = sum(p.opt_home == CPU for p in stood_in.params.spec.placements)
    assert 0 < host_units and len(copied) == 2 * host_units  # two steps, each host unit's sum once
    for a, b in zip(zf.gather_params(plain).values(), zf.gather_params(stood_in).values()):
        assert torch.equal(a, b)


def test_the_disk_is_measured_when_asked_and_never_inside_a_step(tmp_path, monkeypatch):
    monkeypatch.setenv("ZFUNC_CACHE_DIR", str(tmp_path / "cache"))
    swap = tmp_path / "swap"
    swap.mkdir()
    assert rates.cached_disk(swap) is None
    read, write = rates.measure_disk(swap, nbytes=8 << 20)
    assert read > 0 and write > 0 and rates.cached_disk(swap) == (read, write)
    assert not [p for p in swap.iterdir()]  # its file is gone


@pytest.mark.parametrize("measured", [False, True])
def test_an_nvme_step_reports_its_disk_roofline_where_the_disk_was_measured(tmp_path, monkeypatch, measured):
    monkeypatch.setenv("ZFUNC_CACHE_DIR", str(tmp_path / "cache"))
    swap = tmp_path / "swap"
    swap.mkdir()
    if measured:  # fake rates, written where measure_disk keeps them
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "rates.json").write_text(json.dumps({rates.disk_key(swap): {"read": 1e9, "write": 5e8}}))

    def loss_fn(params, b):
        return nn.functional.mse_loss(zf.apply(model, params, b[0]), b[1])

    model = SeededNet()
    step = zf.zero3(zf.offload_nvme(zf.train_step(loss_fn, zf.optim.adamw(1e-2),
                                                  units=lambda name, m: isinstance(m, nn.Sequential)), swap))
    with step.init(model) as state:
        for _ in range(2):
            state, metrics = step(state, (torch.randn(8, 6), torch.randn(8, 2)))
    assert ("offload" in metrics) == measured
    if measured:
        r, io = metrics["offload"], metrics["nvme"]
        assert r["disk_bytes"] == io["bytes_read"] + io["bytes_written"] > 0
        assert r["disk_s"] == pytest.approx(io["bytes_read"] / 1e9 + io["bytes_written"] / 5e8)
        assert r["bound_s"] == max(r["compute_s"], r["disk_s"]) and r["binds"] in ("compute", "disk")
        assert r["compute_s"] > 0 and r["update_s"] > 0 and r["disk_fraction"] > 0


def test_the_roofline_counts_as_serial_what_the_next_forward_must_wait_for():
    """The next forward needs every unit within its first micro-batch's forward (a third of the
    compute over the micro-batches): the host update that forward cannot cover is serial; where it
    covers all of it, only the first unit's update and upload are."""
    rates = zf.Rates(host_update=1e9, device_update=1e10, pcie=1e10)
    covered = offload_plan.roofline(3.0, 0.1, host_params=10**9, first_params=10**8, copy_bytes=2, rates=rates)
    assert covered["serial_s"] == pytest.approx(0.1 + 0.02)  # 1 s of host update inside a 1 s forward
    assert covered["bound_s"] == pytest.approx(3.12) and covered["binds"] == "compute"
    eight = offload_plan.roofline(3.0, 0.1, host_params=10**9, first_params=10**8, copy_bytes=2, rates=rates,
                                  micro_batches=8)
    assert eight["serial_s"] == pytest.approx(1.0 - 3.0 / 24)  # one micro-batch's forward covers an eighth
    waited = offload_plan.roofline(3.5, 0.1, host_params=10**9, first_params=10**8, copy_bytes=2, rates=rates,
                                   waited_s=0.5, micro_batches=8)
    assert waited["bound_s"] == pytest.approx(eight["bound_s"]) and waited["waited_s"] == 0.5  # waits are not compute
    assert waited["achieved"] == pytest.approx(waited["bound_s"] / 3.6)


def test_the_steps_roofline_counts_the_bytes_it_moved_once():
    """The update records the bytes it moved in all; the roofline takes bytes a parameter. The step
    once passed the total, so on an H200 a step's copies read 1.2e8 s and its PCIe traffic 6.6e9 GB."""
    offload = zf.offload_cpu(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), overlap=False).transforms[-1]
    offload.rates = zf.Rates(host_update=1e9, device_update=1e10, pcie=1e10)
    offload._record.update(started=1.0, ended=1.5, host_params=10**9, first_params=10**8, pcie_bytes=6 * 10**9)
    r = offload.step_metrics(None, 0.0)["offload"]
    assert r["pcie_bytes"] == 6 * 10**9 and r["copies_s"] == pytest.approx(0.6)
    assert r["host_update_s"] == pytest.approx(1.0)
    assert r["bound_s"] == pytest.approx(1.0 + (1.0 - 1.0 / 3))  # compute, then the host update its forward leaves


def test_the_rates_are_measured_before_the_first_step_works(monkeypatch):
    """Measured after a step, the update running behind it shared the host's cores (on an H200 the CPU
    Adam measured a twentieth of its rate): the rates are taken as the first step begins, once."""
    cpu = importlib.import_module("zfunc.transforms.offload.cpu")
    calls = []
    monkeypatch.setattr(cpu, "measure_rates", lambda device: calls.append(device) or zf.Rates(1e9, 1e10, 1e10))
    model = nn.Linear(4, 1)
    step = zf.zero3(zf.offload_cpu(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), zf.optim.adamw(1e-3))))
    offload = next(t for t in step.transforms if t.name == "offload_cpu")
    state = step.init(model)
    offload.begin_step(state)
    assert len(calls) == 1 and offload.rates is not None
    for _ in range(2):
        state, metrics = step(state, torch.randn(2, 4))
    assert len(calls) == 1 and "offload" in metrics


# ------------------------------------------------------------ offload_nvme: host memory, then the disk


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.integers(0, 20000))
def test_the_host_plan_fits_its_budget_and_sends_the_rest_to_disk(sizes, budget):
    units = [(f"u{i}", n) for i, n in enumerate(sizes)]
    plan = offload_plan.plan_for_host_budget(units, budget=budget, state_bytes=12, disk=(1e9, 5e8))
    assert plan.device_units == () and plan.host_bytes <= budget
    assert set(plan.host_units) | set(plan.disk_units) == {n for n, _ in units}
    assert not set(plan.host_units) & set(plan.disk_units)
    assert all(n * 12 > budget - plan.host_bytes for name, n in units if name in plan.disk_units)
    on_disk = 12 * sum(n for name, n in units if name in plan.disk_units)
    assert list(plan.predicted.values()) == [pytest.approx(on_disk / 1e9 + on_disk / 5e8)]


def _nvme_train(swap, precision=False, steps=3, **split):
    model = SeededNet()

    def loss_fn(params, b):
        return nn.functional.mse_loss(zf.apply(model, params, b[0]).float(), b[1])

    opt = zf.optim.chain(zf.optim.clip_by_global_norm(0.5), zf.optim.adamw(1e-2))
    step = zf.train_step(loss_fn, opt, units=lambda name, m: isinstance(m, nn.Sequential))
    if precision:
        step = zf.mixed_precision(step, torch.bfloat16)
    step = zf.zero3(zf.offload_nvme(step, swap, sub_group_size=100, buffer_size=1000, **split))
    g = torch.Generator().manual_seed(1)
    with step.init(model) as state:
        files = sorted(p.name for p in swap.rglob("*.swp"))
        for _ in range(steps):
            state, _ = step(state, (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)))
        homes = {u.name: p.opt_home for u, p in zip(state.params.spec.model.units, state.params.spec.placements)}
        return zf.gather_params(state), homes, files, zf.memory_report(state)


@pytest.mark.parametrize("precision", [False, True])
def test_optimizer_state_kept_in_host_memory_equals_it_on_disk(tmp_path, precision):
    """``offload_nvme(host_budget=)``: the first units' optimizer state (and master) in RAM, the rest
    in swap files, and no file for what stays in RAM; bit for bit all of it on disk."""
    disk, _, all_files, _ = _nvme_train(tmp_path / "a", precision)
    budget = (160 + 16 * 17) * (16 if precision else 12)  # the root and one block (moments, steps, master)
    split, homes, files, memory = _nvme_train(tmp_path / "b", precision, host_budget=budget)
    assert homes == {"": CPU, "blocks.0": CPU, "blocks.1": "nvme", "blocks.2": "nvme"}, homes
    assert not [f for f in files if "exp_avg" in f and ("-blocks.0." in f or f.startswith("u000-"))]
    assert [f for f in files if "exp_avg" in f and "-blocks.2." in f] and len(files) < len(all_files)
    assert memory["by_home"]["disk"] > 0
    for k in disk:
        assert torch.equal(disk[k], split[k]), k


def test_the_host_plan_is_made_saved_and_passed_back(tmp_path):
    model = SeededNet()
    step = zf.zero3(zf.offload_nvme(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-2),
                                                  units=lambda name, m: isinstance(m, nn.Sequential)), tmp_path / "s"))
    plan = zf.plan_offload(step, model, host_budget=(160 + 16 * 17) * 12)
    assert plan.host_units == ("", "blocks.0") and plan.disk_units == ("blocks.1", "blocks.2")
    assert "2 units' optimizer state in host memory" in str(plan) and "2 on disk" in str(plan)
    plan.save(tmp_path / "plan.json")
    assert zf.OffloadPlan.load(tmp_path / "plan.json") == plan
    _, homes, _, _ = _nvme_train(tmp_path / "b", plan=str(tmp_path / "plan.json"))
    assert [n for n, h in homes.items() if h == CPU] == ["", "blocks.0"]
    with pytest.raises(ValueError, match="under offload_nvme, give host_budget="):
        zf.plan_offload(step, model, budget=10)


@pytest.mark.parametrize("kw, match", [
    ({"host_budget": 10, "plan": zf.OffloadPlan((), ("",))}, "one of host_budget= and plan="),
    ({"host_budget": 10, "optimizer": False}, r"optimizer=False\) keeps every unit's optimizer state"),
    ({"host_budget": -1}, "host_budget must be a number of bytes"),
    ({"plan": zf.OffloadPlan(("",), ())}, "keeps no unit's update on the device"),
])
def test_bad_nvme_splits_are_clear_errors(kw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        zf.offload_nvme(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), tmp_path, **kw)


def test_optimizer_state_kept_in_host_memory_equals_it_on_disk_across_ranks(tmp_path):
    args = ("gpt", {}, 3, 2, 4, 0, {"dtype": torch.bfloat16}, 2, 0.5)
    nvme = {"kind": "nvme", "sub_group_size": 500, "buffer_size": 4000}
    disk = workers(2).run(run_composed, *args, False, None, False, None, {**nvme, "path": str(tmp_path / "a")})
    split = workers(2).run(run_composed, *args, False, None, False, None,
                           {**nvme, "path": str(tmp_path / "b"), "host_budget": 40_000})
    for a, b in zip(disk, split):
        assert 0 < b["memory"]["by_home"]["disk"] < a["memory"]["by_home"]["disk"]  # some state stayed in RAM
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


# ------------------------------------------------ plans given to another model; budgets of any number type


class Stack(nn.Module):
    """``depth`` blocks of ``width``: the same unit names at every width."""

    def __init__(self, width: int, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.out = nn.Linear(width, 2)


POLICIES = {"blocks": lambda name, m: isinstance(m, nn.Sequential), "linears": lambda name, m: isinstance(m, nn.Linear)}


def _split_step(kind, policy="blocks", path=None, precision=False, opt=None, **split):
    step = zf.train_step(lambda p, b: 0, opt or zf.optim.adamw(1e-2), units=POLICIES[policy])
    if precision:
        step = zf.mixed_precision(step, torch.bfloat16)
    if kind == "cpu":
        return zf.zero3(zf.offload_cpu(step, copy_grads_on_host=True, **split))
    return zf.zero3(zf.offload_nvme(step, path, sub_group_size=1000, buffer_size=10_000, **split))


def _unit_sizes(model, policy, world=1) -> dict:
    """Each unit's parameters on a rank of ``world``, counted from the model's modules."""
    units = [name for name, m in model.named_modules() if name and POLICIES[policy](name, m)]
    owned = {}
    for name, p in model.named_parameters():
        unit = max((u for u in units if name.startswith(u + ".")), key=len, default="")
        owned[unit] = owned.get(unit, 0) + p.numel()
    return {u: -(-n // world) for u, n in owned.items()}


def _made_plan(kind, step, model, share=2):
    """The plan ``step`` makes for ``model`` with a budget of about 1/``share`` of its optimizer state."""
    key = "budget" if kind == "cpu" else "host_budget"
    full = zf.plan_offload(step, model, rates=FAST, **{key: 10**15})
    return zf.plan_offload(step, model, rates=FAST, **{key: (full.device_bytes or full.host_bytes) // share})


def _kept(kind, state) -> set:
    """The units a split keeps on the device (offload_cpu) or in host memory (offload_nvme)."""
    home = DEVICE if kind == "cpu" else CPU
    return {u.name for u, p in zip(state.params.spec.model.units, state.params.spec.placements) if p.opt_home == home}


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["cpu", "nvme"]), policies=st.sampled_from([("blocks",) * 2, ("linears",) * 2,
                                                                        ("blocks", "linears")]),
       widths=st.tuples(st.sampled_from([3, 8, 9, 800]), st.sampled_from([3, 8, 9, 800])),
       depths=st.sampled_from([(2, 2), (1, 1), (3, 3), (2, 3)]), precision=st.booleans())
def test_a_plan_made_for_another_model_is_refused_at_init_naming_the_unit_and_both_sizes(
        tmp_path_factory, kind, policies, widths, depths, precision):
    """A plan records each unit's size; given to a model whose units differ (other names, or the
    same names at another width: the issue's 8 and 800, which kept 96x the budget on the device)
    ``init`` refuses it, naming a unit that differs with both sizes and what to do; given to a
    model of the same sizes it keeps the units it names."""
    path = tmp_path_factory.mktemp("swap")
    with torch.device("meta"):
        made, given_to = Stack(widths[0], depths[0]), Stack(widths[1], depths[1])
    plan = _made_plan(kind, _split_step(kind, policies[0], path, precision), made)
    assert {k: v for k, v in plan.unit_sizes} == _unit_sizes(made, policies[0])
    assert plan.state_bytes == (12 if precision else 8)  # Adam's two moments (and the fp32 master)
    step = _split_step(kind, policies[1], path, precision, plan=plan)
    a, b = _unit_sizes(made, policies[0]), _unit_sizes(given_to, policies[1])
    if a.keys() != b.keys():
        with pytest.raises(ValueError, match=r"made for other units.*make the plan again .*zf\.plan_offload"):
            step.init(given_to)
    elif a != b:
        with pytest.raises(ValueError, match=r"made for another model: unit .*zf\.plan_offload") as e:
            step.init(given_to)
        name, now, was = re.search(r"unit '(.*)' has (\d+) parameters on this rank, the plan was made for (\d+)",
                                   str(e.value)).groups()
        assert (int(now), int(was)) == (b[name], a[name]) != (a[name], a[name])
        differ = sum(a[u] != b[u] for u in a)
        assert (f"(and {differ - 1} more units differ)" in str(e.value)) == (differ > 1)
    else:
        with step.init(given_to) as state:
            assert _kept(kind, state) == set(plan.device_units if kind == "cpu" else plan.host_units)
    assert not list(path.iterdir())  # nothing left behind either way


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_plan_for_another_optimizer_state_is_refused(tmp_path, kind):
    model = Stack(8)
    plan = _made_plan(kind, _split_step(kind, path=tmp_path), model)
    for other, bytes_ in (({"precision": True}, 12), ({"opt": zf.optim.sgd(0.1)}, 0)):
        with pytest.raises(ValueError, match=rf"made for an optimizer state of 8 bytes a parameter, this step's "
                                             rf"takes {bytes_}"):
            _split_step(kind, path=tmp_path, plan=plan, **other).init(Stack(8))


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_plan_without_unit_sizes_is_checked_by_the_bytes_it_says_it_keeps(tmp_path, kind):
    """A plan saved before plans recorded their units' sizes (or written with only names and bytes):
    its budget and the bytes it says it keeps are checked against the model's own units."""
    plan = _made_plan(kind, _split_step(kind, path=tmp_path), Stack(8))
    old = json.loads(plan.to_json())
    del old["unit_sizes"], old["state_bytes"]
    old = zf.OffloadPlan.from_json(json.dumps(old))
    where, said, budget_key = (("device memory", old.device_bytes, "budget") if kind == "cpu" else
                               ("host memory", old.host_bytes, "host_budget"))
    with _split_step(kind, path=tmp_path, plan=old).init(Stack(8)) as state:  # the model it was made for
        assert _kept(kind, state) == set(old.device_units if kind == "cpu" else old.host_units)
    kept = old.device_units if kind == "cpu" else old.host_units
    used = 8 * sum(n for u, n in _unit_sizes(Stack(800), "blocks").items() if u in kept)
    with pytest.raises(ValueError, match=rf"keeps {used} bytes of optimizer state in {where} in this model, more "
                                         rf"than its {budget_key} of \d+; make the plan again"):
        _split_step(kind, path=tmp_path, plan=old).init(Stack(800))
    unbudgeted = dataclasses.replace(old, **{budget_key: None})
    if kind == "nvme":
        assert unbudgeted.disk_units  # still offload_nvme's plan
    with pytest.raises(ValueError, match=rf"says its units keep {said} bytes of optimizer state in {where}; in this "
                                         rf"model they keep {used}"):
        _split_step(kind, path=tmp_path, plan=unbudgeted).init(Stack(800))
    assert not list(tmp_path.iterdir())


def plan_check_across_ranks(path: str, made_at_one: "zf.OffloadPlan") -> list:
    """At W = 2: the plan made here keeps its units; it is refused for a wider model, and so is a plan
    made at W = 1 for the same model (each rank holds half of each unit)."""
    rank = torch.distributed.get_rank()
    step = _split_step("cpu")
    plan = _made_plan("cpu", step, Stack(8))
    assert dict(plan.unit_sizes) == _unit_sizes(Stack(8), "blocks", world=2)
    state = _split_step("cpu", plan=plan).init(Stack(8))
    out = [_kept("cpu", state) == set(plan.device_units)]
    for given_plan, model in ((plan, Stack(800)), (made_at_one, Stack(8))):
        try:
            _split_step("cpu", plan=given_plan).init(model)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    del rank, path
    return out


def test_the_plan_check_holds_across_ranks(tmp_path):
    made_at_one = _made_plan("cpu", _split_step("cpu"), Stack(8))
    halves, ones = _unit_sizes(Stack(8), "blocks", world=2), _unit_sizes(Stack(8), "blocks")
    for kept, wider, other_world in workers(2).run(plan_check_across_ranks, str(tmp_path), made_at_one):
        assert kept
        assert wider and re.search(r"made for another model: unit '.*' has \d+ parameters on this rank", wider)
        name, now, was = re.search(r"unit '(.*)' has (\d+) parameters on this rank, the plan was made for (\d+)",
                                   other_world).groups()
        assert (int(now), int(was)) == (halves[name], ones[name])


WHOLE = [lambda n: n, float, np.int64, np.uint64, np.float64, lambda n: np.int32(min(n, 2**31 - 1))]
NOT_WHOLE = [1.5, -1, -1.0, True, False, float("nan"), float("inf"), -float("inf"), "4e9", np.float32(2.5),
             np.bool_(True), 4e9 + 0.5, [4]]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**53), st.sampled_from(WHOLE))
def test_any_integral_budget_is_taken_as_its_int(n, as_type):
    """``budget=4e9``: DeepSpeed configs write floats; any integral number is its int, everywhere a
    budget is given."""
    value = as_type(n)
    expected = int(value)
    ts = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))
    cpu = next(t for t in zf.offload_cpu(ts, budget=value).transforms if t.family == "offload")
    nvme = next(t for t in zf.offload_nvme(ts, "/tmp/x", host_budget=value).transforms if t.family == "offload")
    assert type(cpu.budget) is int and cpu.budget == expected
    assert type(nvme.host_budget) is int and nvme.host_budget == expected
    assert offload_plan.plan_for_budget(UNITS, budget=value, rates=FAST, state_bytes=12, copy_bytes=4) == \
        offload_plan.plan_for_budget(UNITS, budget=expected, rates=FAST, state_bytes=12, copy_bytes=4)
    assert offload_plan.plan_for_host_budget(UNITS, budget=value, state_bytes=12).host_budget == expected
    if n:  # the pool's sizes: at least one
        sizes = next(t for t in zf.offload_nvme(ts, "/tmp/x", buffer_count=value, buffer_size=value,
                                                sub_group_size=value).transforms if t.family == "offload")
        assert (sizes.buffer_count, sizes.buffer_size) == (expected, expected)


def test_a_float_budget_plans_as_its_int(tmp_path):
    """The issue's ``budget=4e9`` and ``host_budget=4e9``, through init and ``plan_offload``."""
    model = Stack(8)
    for kind, key in (("cpu", "budget"), ("nvme", "host_budget")):
        step = _split_step(kind, path=tmp_path, rates=FAST, **{key: 4e9}) if kind == "cpu" else \
            _split_step(kind, path=tmp_path, **{key: 4e9})
        with step.init(Stack(8)) as state:
            assert _kept(kind, state) == {u.name for u in state.params.spec.model.units}  # all fit in 4 GB
        plan = zf.plan_offload(_split_step(kind, path=tmp_path), model, rates=FAST, **{key: np.float64(4e9)})
        assert getattr(plan, key) == 4_000_000_000 and type(getattr(plan, key)) is int


@pytest.mark.parametrize("value", NOT_WHOLE, ids=repr)
def test_a_budget_that_is_no_whole_number_of_bytes_is_refused_naming_it(value, tmp_path):
    ts = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))
    word = r"(a number of bytes >= 0|a positive number of (elements|buffers)), a whole one .* got "
    calls = [("budget", lambda: zf.offload_cpu(ts, budget=value)),
             ("host_budget", lambda: zf.offload_nvme(ts, tmp_path, host_budget=value)),
             ("budget", lambda: zf.plan_offload(_split_step("cpu"), Stack(3), budget=value)),
             ("host_budget", lambda: zf.plan_offload(_split_step("nvme", path=tmp_path), Stack(3), host_budget=value)),
             ("budget", lambda: offload_plan.plan_for_budget(UNITS, budget=value, rates=FAST, state_bytes=12,
                                                             copy_bytes=4)),
             ("budget", lambda: offload_plan.plan_for_host_budget(UNITS, budget=value, state_bytes=12))]
    calls += [(key, lambda key=key: zf.offload_nvme(ts, tmp_path, **{key: value}))
              for key in ("buffer_count", "buffer_size", "sub_group_size")]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"{name} must be {word}{re.escape(repr(value))}"):
            call()
    with pytest.raises(ValueError, match=r"buffer_size must be a positive number of elements"):
        zf.offload_nvme(ts, tmp_path, buffer_size=0)


# ------------------------------------------------ optimizer state kept in host memory, counted at init


def _needed(step, model) -> int:
    """The bytes ``step.init`` says it needs, from its error on a machine with no memory to give."""
    with pytest.raises(MemoryError) as e:
        step.init(model)
    return int(re.search(r"needs at least (\d+) bytes", str(e.value)).group(1))


@pytest.mark.parametrize("precision", [False, True])
@pytest.mark.parametrize("params", [True, False])
def test_optimizer_state_kept_in_host_memory_is_counted_at_init(tmp_path, monkeypatch, precision, params):
    """``offload_nvme(host_budget=)`` far beyond the machine's memory: init counts the optimizer
    state (and master) the split keeps in RAM with the pool and staging, and refuses, before any
    file is made, what the available memory cannot hold, saying how much is needed and available."""
    plans = importlib.import_module("zfunc.transforms.offload.plan")

    def nvme(**split):
        return _split_step("nvme", "blocks", tmp_path, precision, params=params, **split)

    huge = 1000 * (plans.available_memory() or 2**40)  # the issue's: 1000x this machine's memory
    model = Stack(40, 3)
    kept = 8 + 4 * precision  # bytes a parameter: Adam's moments (and the fp32 master)
    host = kept * sum(_unit_sizes(model, "blocks").values())  # every unit's state fits the budget
    monkeypatch.setattr(plans, "available_memory", lambda: 0)
    base = _needed(nvme(), Stack(40, 3))  # the pool, the staging sets, the largest unit
    assert _needed(nvme(host_budget=huge), Stack(40, 3)) == base + host
    monkeypatch.setattr(plans, "available_memory", lambda: base + host - 1)
    with pytest.raises(MemoryError, match=rf"offload_nvme needs at least {base + host} bytes of host memory on this "
                                          rf"rank \(.*optimizer state kept in host memory {host}\), 1 more than the "
                                          rf"{base + host - 1} bytes available: keep less optimizer state in host "
                                          rf"memory \(a smaller host_budget="):
        nvme(host_budget=huge).init(Stack(40, 3))
    assert not list(tmp_path.iterdir())  # refused before any file or folder was made
    plan = zf.plan_offload(nvme(), model, host_budget=huge)
    with pytest.raises(MemoryError, match=rf"optimizer state kept in host memory {host}\)"):
        nvme(plan=plan).init(Stack(40, 3))  # a plan keeps as much
    with nvme(host_budget=host // 2).init(Stack(40, 3)):  # half of it fits, beside the rest
        pass
    with nvme().init(Stack(40, 3)):
        pass
    monkeypatch.setattr(plans, "available_memory", lambda: base + host)
    with nvme(host_budget=huge).init(Stack(40, 3)):
        pass
    assert not list(tmp_path.iterdir())


def test_offload_nvme_without_optimizer_offload_counts_all_of_it(tmp_path, monkeypatch):
    plans = importlib.import_module("zfunc.transforms.offload.plan")
    monkeypatch.setattr(plans, "available_memory", lambda: 1000)
    state = 8 * sum(_unit_sizes(Stack(40, 3), "blocks").values())
    with pytest.raises(MemoryError, match=rf"optimizer state kept in host memory {state}\).*: put the optimizer "
                                          r"state on disk \(optimizer=True\)"):
        _split_step("nvme", path=tmp_path, optimizer=False).init(Stack(40, 3))


@pytest.mark.parametrize("precision", [False, True])
def test_offload_cpu_counts_the_optimizer_state_it_keeps_on_the_host(monkeypatch, precision):
    plans = importlib.import_module("zfunc.transforms.offload.plan")
    sizes = _unit_sizes(Stack(40, 3), "blocks")
    host = (8 + 4 * precision) * sum(sizes.values())
    monkeypatch.setattr(plans, "available_memory", lambda: host - 1)
    with pytest.raises(MemoryError, match=rf"offload_cpu needs at least {host} bytes of host memory on this rank "
                                          rf"\(optimizer state kept in host memory {host}\), 1 more than the {host - 1} "
                                          r"bytes available: keep more units' update on the device"):
        _split_step("cpu", precision=precision).init(Stack(40, 3))
    _split_step("cpu", precision=precision, ratio=0.0).init(Stack(40, 3))  # all of it on the device: none needed
    first = next(iter(sizes))
    plan = zf.OffloadPlan((first,), tuple(u for u in sizes if u != first))  # by hand: the rest on the host
    rest = host - (8 + 4 * precision) * sizes[first]
    monkeypatch.setattr(plans, "available_memory", lambda: rest)
    _split_step("cpu", precision=precision, plan=plan).init(Stack(40, 3))
    monkeypatch.setattr(plans, "available_memory", lambda: rest - 1)
    with pytest.raises(MemoryError, match=rf"needs at least {rest} bytes"):
        _split_step("cpu", precision=precision, plan=plan).init(Stack(40, 3))
