"""zf.offload_cpu: equal to plain PyTorch (fp32) and, bit for bit, to the same step without
offload (every stage, W = 1, 2, 3, with mixed precision and accumulation); where its state
lives; composition errors. The parameter tier (``params=True``): equal to zero3 without it,
its shards' life (on the host between steps, copied before each use, nothing left after),
checkpoints."""
import copy
import gc
import os
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zfunc as zf
from assertions import assert_close_to, assert_same_run
from cases import _setup, compose, reference, run_composed
from checkpoints import assert_same_numbers
from models import DEEP_MLP as MLP, MODEL_KW, batch, local
from workers import workers

CPU = {"kind": "cpu"}


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["gpt", "deep_mlp", "checkpointed", "external"])
def test_equals_plain_pytorch(name, world):
    """fp32, relative 1e-5, for zero1/2/3(offload_cpu(f)) and offload_cpu(f) alone."""
    kw = MODEL_KW[name]
    expected = reference(name, kw, steps=3, batch_size=2 * world)
    for stage in (0, 1, 2, 3):
        for r in workers(world).run(run_composed, name, kw, stage, 3, 2, 0, None, None, None, False, None,
                                    False, None, CPU):
            assert r["composition"].count("offload_cpu") == 1
            assert_close_to(r["params"], expected["params"])
            assert [h["loss"] for h in r["history"]] == pytest.approx(expected["losses"], rel=1e-5)


def _pair(name, stage, precision, micro, clip, world):
    """The same run with and without offload_cpu, on every rank."""
    kw = MODEL_KW[name]
    args = (name, kw, stage, 2, 4, 0, precision, micro, clip)
    plain = workers(world).run(run_composed, *args)
    offloaded = workers(world).run(run_composed, *args, False, None, False, None, CPU)
    return plain, offloaded


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_equals_the_step_without_offload_under_mixed_precision_and_accumulation(stage, world):
    """On the CPU the copies are skipped and the same fused kernel updates the same
    tensors: bf16 with fp32 master weights, 2 micro-batches, clipping, all unchanged."""
    plain, offloaded = _pair("deep_mlp", stage, {"dtype": torch.bfloat16}, 2, 0.5, world)
    for a, b in zip(plain, offloaded):
        assert_same_run(a, b)
        assert b["dtypes"] == ["torch.bfloat16"]
        assert b["memory"]["optimizer_bytes"] == a["memory"]["optimizer_bytes"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_copied_as_each_backward_finishes_equal_the_step_without_offload(world):
    for stage in (0, 1, 2, 3):
        args = ("gpt", {}, stage, 2, 4, 0, {"dtype": torch.bfloat16}, None, 0.5)
        plain = workers(world).run(run_composed, *args)
        early = workers(world).run(run_composed, *args, False, None, False, None, {**CPU, "copy_grads_on_host": True})
        for a, b in zip(plain, early):
            assert_same_run(a, b)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["deep_mlp", "odd_mlp", "gpt"]), stage=st.sampled_from([0, 1, 2, 3]),
       precision=st.sampled_from([None, {"dtype": torch.bfloat16}]), micro=st.sampled_from([None, 2]),
       clip=st.sampled_from([None, 0.1]), world=st.sampled_from([1, 2]))
def test_any_composition_equals_the_step_without_offload(name, stage, precision, micro, clip, world):
    plain, offloaded = _pair(name, stage, precision, micro, clip, world)
    for a, b in zip(plain, offloaded):
        assert_same_run(a, b)


def test_memory_report_splits_bytes_by_home():
    """On a CPU-only machine every byte is in RAM, reported as the device's; the homes add up."""
    (r,) = workers(1).run(run_composed, "deep_mlp", MLP, 0, 1, 2, 0, {"dtype": torch.bfloat16}, None, None,
                          False, None, False, None, CPU)
    mem = r["memory"]
    by_home = mem["by_home"]
    assert set(by_home) == {"device", "pinned", "host", "disk"}
    assert by_home["disk"] == 0 and mem["swap_buffer_bytes"] == 0
    model_state = mem["param_bytes"] + mem["optimizer_bytes"] + mem["frozen_bytes"] + mem["buffer_bytes"]
    assert sum(by_home.values()) >= model_state  # plus the step counters
    if not torch.cuda.is_available():
        assert by_home["pinned"] == by_home["host"] == 0


def _step():
    return zf.train_step(lambda p, b: p["w"].sum(), zf.optim.adamw(1e-3))


def test_composition_errors_name_the_order_to_write():
    with pytest.raises(ValueError, match=r"offload_cpu must go inside the ZeRO stage.*zero3\(offload_cpu\(f\)\)"):
        zf.offload_cpu(zf.zero3(_step()))
    with pytest.raises(ValueError, match="already applied; apply offload transforms once"):
        zf.offload_cpu(zf.offload_cpu(_step()))
    with pytest.raises(ValueError, match=r"mixed_precision must go inside offload_cpu.*"
                                         r"zeroN\(offload_cpu\(mixed_precision\(f, dtype\)\)\)"):
        zf.mixed_precision(zf.offload_cpu(_step()))
    with pytest.raises(TypeError, match="offload_cpu transforms a zfunc Step"):
        zf.offload_cpu(lambda s, b: None)


def test_offload_is_named_in_the_plan_and_placement():
    step = zf.zero3(zf.offload_cpu(zf.mixed_precision(_step())))
    assert step.composition == "zero3(offload_cpu(mixed_precision(train_step, bfloat16)))"
    place = step.placement(_FakeUnit())
    assert (place.opt_home, place.grad_home, place.param_home) == ("cpu", "cpu", "device")


class _FakeUnit:
    name = ""

    class trainable:
        numel = 10

    class frozen:
        numel = 0
        entries = ()
        dtype = torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host copies of CUDA parameters")
def test_cuda_parameters_updated_on_the_host():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).cuda()
    x = torch.randn(4, 8, device="cuda")

    def loss_fn(params, b):
        return zf.apply(model, params, b).square().mean()

    results = []
    for offload in (False, True):
        step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
        step = zf.offload_cpu(step) if offload else step
        state = step.init(copy.deepcopy(model))
        for _ in range(3):
            state, _ = step(state, x)
        if offload:
            assert all(t.device.type == "cuda" for t in state.params.leaves)
            assert zf.memory_report(state)["by_home"]["pinned"] > 0
        results.append(zf.gather_params(state))
    assert_close_to(results[1], results[0])


# ------------------------------------------------------------ the parameter tier (params=True)

TIER = {"kind": "cpu", "params": True}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "checkpointed", "external"])
def test_parameter_tier_equals_zero3_and_plain_pytorch(name, world):
    """fp32: bit for bit zero3 without the tier (on the CPU its copies are plain ones), plain
    PyTorch to 1e-5; the checkpointed model copies units in again in backward."""
    kw = MODEL_KW[name]
    expected = reference(name, kw, steps=3, batch_size=2 * world)
    args = (name, kw, 3, 3, 2, 0, None, None, None)
    plain = workers(world).run(run_composed, *args)
    tier = workers(world).run(run_composed, *args, False, None, False, None, TIER)
    for a, b in zip(plain, tier):
        assert b["composition"] == "zero3(offload_cpu(train_step, params=True))"
        assert_same_run(a, b)
        assert_close_to(b["params"], expected["params"])
        assert b["history"][-1]["prefetch"]["hits"] > 0  # copies issued ahead of use, even at W = 1


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("precision,micro,clip,early", [
    (None, 2, 0.5, False), ({"dtype": torch.bfloat16}, None, 0.5, True), ({"dtype": torch.bfloat16}, 2, 0.5, False)])
def test_parameter_tier_under_mixed_precision_accumulation_and_clipping(precision, micro, clip, early, world):
    """bf16 shards on the host with fp32 master weights, 2 micro-batches, clipping; ``early``: each
    gradient through the host-copy sink a GPU run takes."""
    args = ("deep_mlp", MLP, 3, 2, 4, 0, precision, micro, clip)
    plain = workers(world).run(run_composed, *args)
    tier = workers(world).run(run_composed, *args, False, None, False, None, {**TIER, "copy_grads_on_host": early})
    for a, b in zip(plain, tier):
        assert_same_run(a, b)
        assert b["dtypes"] == (["torch.bfloat16"] if precision else ["torch.float32"])
        assert b["memory"]["optimizer_bytes"] == a["memory"]["optimizer_bytes"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["deep_mlp", "odd_mlp", "gpt"]), precision=st.sampled_from([None, {"dtype": torch.bfloat16}]),
       micro=st.sampled_from([None, 2]), clip=st.sampled_from([None, 0.1]), world=st.sampled_from([1, 2, 3]))
def test_any_parameter_tier_composition_equals_zero3_without_it(name, precision, micro, clip, world):
    args = (name, MODEL_KW[name], 3, 2, 4, 0, precision, micro, clip)
    for a, b in zip(workers(world).run(run_composed, *args),
                    workers(world).run(run_composed, *args, False, None, False, None, TIER)):
        assert_same_run(a, b)


def tier_life(persistent: bool) -> dict:
    """Three steps of zero3(offload_cpu(f, params=True)) on gpt, every copy to the device watched
    (``persistent``: the smallest units below the persistence threshold); and the same steps
    without the tier."""
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    probe = compose(3, loss_fn).init(copy.deepcopy(model), free_model=False)
    sizes = [u.trainable.numel + u.frozen.numel for u in probe.params.spec.model.units]
    threshold = min(sizes) + 1 if persistent else 0
    made = []
    real = zf.placement._copy_in

    def spy(place, leaf, group, ready):
        pending = real(place, leaf, group, ready)
        assert pending.out.data_ptr() != leaf.data_ptr()  # a new buffer, never the shard itself
        made.append(weakref.ref(pending.out))
        return pending

    step = compose(3, loss_fn, threshold=threshold, offload=TIER)
    state = step.init(model)
    homes = [p.param_home for p in state.params.spec.placements]
    shards = [t.data_ptr() for t in state.params.leaves]
    out = {"homes": homes, "sizes": sizes, "threshold": threshold, "steps": []}
    zf.placement._copy_in = spy
    try:
        for i in range(3):
            n = len(made)
            state, metrics = step(state, local(batch("gpt", shape_model, i, 6), rank, world))
            gc.collect()
            out["steps"].append({
                "copies": len(made) - n, "prefetch": metrics["prefetch"],
                "alive": sum(r() is not None for r in made),  # copies still alive after the step
                "on_host": all(t.device.type == "cpu" for t, h in zip(state.params.leaves, homes) if h == "cpu"),
                "in_place": [t.data_ptr() for t in state.params.leaves] == shards,
            })
    finally:
        zf.placement._copy_in = real
    out["host_copy"] = state.opt_state.params  # None: the optimizer updated the stored shards themselves
    out["memory"] = zf.memory_report(state)
    out["params"] = zf.gather_params(state)
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    plain = compose(3, loss_fn, threshold=threshold)
    state = plain.init(model)
    for i in range(3):
        state, _ = plain(state, local(batch("gpt", shape_model, i, 6), rank, world))
    out["plain"] = zf.gather_params(state)
    return out


@pytest.mark.parametrize("world,persistent", [(1, False), (2, False), (2, True), (3, True)])
def test_parameter_tier_life(world, persistent):
    """Between steps each shard is on the host, updated in place; before each use it is copied
    (the coordinator copying ahead); after the step no copy is alive; persistent units stay on
    the device and are never copied."""
    for r in workers(world).run(tier_life, persistent):
        for home, size in zip(r["homes"], r["sizes"]):
            assert home == ("device" if size < r["threshold"] else "cpu")
        assert "device" in r["homes"] if persistent else set(r["homes"]) == {"cpu"}
        host_units = sum(h == "cpu" for h in r["homes"])
        for i, s in enumerate(r["steps"]):
            assert s["on_host"] and s["in_place"]
            assert s["copies"] >= host_units  # every host unit copied before forward used it
            assert s["copies"] == s["prefetch"]["hits"] + s["prefetch"]["misses"]
            assert s["alive"] == 0
            if i:
                assert s["prefetch"]["hits"] > 0
        assert r["host_copy"] is None
        by_home = r["memory"]["by_home"]
        if torch.cuda.is_available():
            assert by_home["pinned"] > 0
        else:
            assert by_home["pinned"] == by_home["host"] == 0
        for k in r["plain"]:
            assert torch.equal(r["params"][k], r["plain"][k]), k


def tier_save(directory: str, tier: bool) -> None:
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    step = compose(3, loss_fn, offload=TIER if tier else None)
    state = step.init(model)
    state, _ = step(state, local(batch("gpt", shape_model, 0, 6), rank, world))
    zf.checkpoint.save(state, os.path.join(directory, "src"), "t")


def tier_load_train(directory: str, tier: bool, bf16: bool) -> dict:
    """Load the checkpoint into this composition, save what was loaded, train two more steps."""
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    step = compose(3, loss_fn, precision={"dtype": torch.bfloat16} if bf16 else None, offload=TIER if tier else None)
    state, _ = zf.checkpoint.load(step.init(model), os.path.join(directory, "src"))
    assert all(t.device.type == "cpu" for t in state.params.leaves)
    zf.checkpoint.save(state, os.path.join(directory, f"tgt-{tier}-{bf16}-w{world}"), "t")
    for i in (1, 2):
        state, _ = step(state, local(batch("gpt", shape_model, i, 6), rank, world))
    return {"params": zf.gather_params(state), "count": int(state.count)}


def test_parameter_tier_checkpoints_round_trip(tmp_path):
    """Saved from the tier at W = 2, loaded into the tier and into zero3 without it (the same
    numbers, training on bit for bit alike and as plain PyTorch), at W = 3, and under bf16; and a
    checkpoint of zero3 without the tier loads into it."""
    directory = str(tmp_path)
    expected = reference("gpt", {}, steps=3, batch_size=6)
    workers(2).run(tier_save, directory, True)
    tier = workers(2).run(tier_load_train, directory, True, False)
    plain = workers(2).run(tier_load_train, directory, False, False)
    for a, b in zip(tier, plain):
        assert a["count"] == 3
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert_close_to(a["params"], expected["params"])
    for r in workers(3).run(tier_load_train, directory, True, False):
        assert_close_to(r["params"], expected["params"])
    workers(1).run(tier_load_train, directory, True, True)
    for name in ("True-False-w2", "False-False-w2", "True-False-w3", "True-True-w1"):
        assert_same_numbers(os.path.join(directory, "src"), os.path.join(directory, "tgt-" + name))
    other = tmp_path / "from-plain"
    workers(3).run(tier_save, str(other), False)
    for r in workers(2).run(tier_load_train, str(other), True, False):
        assert_close_to(r["params"], expected["params"])


def test_the_parameter_tier_needs_zero3():
    for zero in (zf.zero1, zf.zero2):
        with pytest.raises(ValueError, match=r"offload_cpu\(params=True\) needs zero3.*zero3\(offload_cpu\(f, "
                                             r"params=True\)\)"):
            zero(zf.offload_cpu(_step(), params=True))
    model = torch.nn.Linear(2, 2)
    step = zf.offload_cpu(zf.train_step(lambda p, b: zf.apply(model, p, b).sum(), zf.optim.adamw(1e-3)), params=True)
    with pytest.raises(ValueError, match=r"offload_cpu\(params=True\) needs zero3.*zero3\(offload_cpu\(f, params=True"):
        step.init(model)


def test_parameter_tier_is_named_in_the_plan_and_placement():
    inner = zf.offload_cpu(zf.mixed_precision(_step()), params=True)
    step = zf.zero3(inner)
    assert step.composition == "zero3(offload_cpu(mixed_precision(train_step, bfloat16), params=True))"
    place = step.placement(_FakeUnit())
    assert (place.params, place.param_home, place.opt_home, place.grad_home) == ("sharded", "cpu", "cpu", "cpu")
    persistent = zf.zero3(zf.offload_cpu(zf.mixed_precision(_step()), params=True), persistence_threshold=11)
    place = persistent.placement(_FakeUnit())  # 10 elements: stays whole on the device
    assert (place.params, place.param_home, place.opt_home) == ("replicated", "device", "cpu")
