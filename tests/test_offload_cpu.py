"""zf.offload_cpu: equal to plain PyTorch (fp32) and, bit for bit, to the same step without
offload (every stage, W = 1, 2, 3, with mixed precision and accumulation); where its state
lives; composition errors."""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zfunc as zf
from cases import reference, run_composed
from test_zero_equivalence import assert_close_to
from workers import workers

MLP = {"d_in": 5, "width": 16, "depth": 3, "d_out": 3}
CPU = {"kind": "cpu"}
KW = {"deep_mlp": MLP, "odd_mlp": {}, "gpt": {}, "checkpointed": {}, "external": {}}


def _same(a: dict, b: dict) -> None:
    """Bit for bit: parameters and the loss of every step."""
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "deep_mlp", "checkpointed", "external"])
def test_equals_plain_pytorch(name, world):
    """fp32, relative 1e-5, for zero1/2/3(offload_cpu(f)) and offload_cpu(f) alone."""
    kw = KW[name]
    expected = reference(name, kw, steps=3, batch_size=2 * world)
    for stage in (0, 1, 2, 3):
        for r in workers(world).run(run_composed, name, kw, stage, 3, 2, 0, None, None, None, False, None,
                                    False, None, CPU):
            assert r["composition"].count("offload_cpu") == 1
            assert_close_to(r["params"], expected["params"])
            assert [h["loss"] for h in r["history"]] == pytest.approx(expected["losses"], rel=1e-5)


def _pair(name, stage, precision, micro, clip, world):
    """The same run with and without offload_cpu, on every rank."""
    kw = KW[name]
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
        _same(a, b)
        assert b["dtypes"] == ["torch.bfloat16"]
        assert b["memory"]["optimizer_bytes"] == a["memory"]["optimizer_bytes"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_copied_as_each_backward_finishes_equal_the_step_without_offload(world):
    for stage in (0, 1, 2, 3):
        args = ("gpt", {}, stage, 2, 4, 0, {"dtype": torch.bfloat16}, None, 0.5)
        plain = workers(world).run(run_composed, *args)
        early = workers(world).run(run_composed, *args, False, None, False, None, {**CPU, "copy_grads_on_host": True})
        for a, b in zip(plain, early):
            _same(a, b)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["deep_mlp", "odd_mlp", "gpt"]), stage=st.sampled_from([0, 1, 2, 3]),
       precision=st.sampled_from([None, {"dtype": torch.bfloat16}]), micro=st.sampled_from([None, 2]),
       clip=st.sampled_from([None, 0.1]), world=st.sampled_from([1, 2]))
def test_any_composition_equals_the_step_without_offload(name, stage, precision, micro, clip, world):
    plain, offloaded = _pair(name, stage, precision, micro, clip, world)
    for a, b in zip(plain, offloaded):
        _same(a, b)


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
