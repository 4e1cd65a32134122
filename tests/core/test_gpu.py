"""On a GPU: every composition at W = 1, its parameters on CUDA and its collectives over nccl,
equals the same composition on the CPU (gloo) and plain PyTorch on the GPU.

Skipped without CUDA; ``benchmarks/gpu_check.py`` runs it on the GPU machine.
"""
import copy

import pytest
import torch

from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from cases import reference, reference_mixed, run_composed
from checkpoints import GLOBAL_BATCH, load_then_train, train_then_save
from compositions import COMPOSITIONS, FP16_SCALE
from models import build
from workers import workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and nccl (the GPU machine)")

MODELS = {"gpt": {}, "checkpointed": {}, "external": {}, "frozen_bn": {}}


def _pairs():
    """Every composition on every model, except accumulation on BatchNorm (a micro-batch of two
    makes BN's gradients rounding noise, which Adam turns into +-lr on either device)."""
    for c, spec in COMPOSITIONS.items():
        for name in MODELS:
            if name == "frozen_bn" and "micro" in spec:
                continue
            yield c, name


def _run(backend: str, name: str, c: dict, tmp_path) -> dict:
    offload = c.get("offload")
    if offload is not None and offload["kind"] == "nvme":
        offload = {**offload, "path": str(tmp_path / backend)}
    device = "cuda" if backend == "nccl" else "cpu"
    precision = c.get("precision")
    if precision is not None and name == "frozen_bn":  # adds a buffer to activations: buffers in the dtype too
        precision = precision | {"buffer_dtype": precision["dtype"]}
    (result,) = workers(1, backend).run(run_composed, name, MODELS[name], c["stage"], 3, 4, 0, precision,
                                         c.get("micro"), c.get("clip"), False, None, False, None, offload, None,
                                         device)
    return result


@pytest.mark.parametrize("composition,name", list(_pairs()))
def test_composition_on_cuda_equals_cpu_and_pytorch(composition, name, tmp_path):
    c = COMPOSITIONS[composition]
    gpu = _run("nccl", name, c, tmp_path)
    cpu = _run("gloo", name, c, tmp_path)
    offload = c.get("offload") or {}
    # swap-file placeholders on NVMe; host shards in the CPU parameter tier; else the GPU
    home = "meta" if offload.get("kind") == "nvme" else "cpu" if offload.get("params") else "cuda:0"
    assert gpu["devices"] == [home], gpu["devices"]
    precision = c.get("precision")
    if precision is None:
        expected = reference(name, MODELS[name], steps=3, batch_size=4, clip=c.get("clip"), device="cuda")
        assert_close_to(gpu["params"], cpu["params"])
        assert_close_to(gpu["params"], expected["params"])
        assert [h["loss"] for h in gpu["history"]] == pytest.approx(expected["losses"], rel=1e-5)
    else:
        dtype = precision["dtype"]
        init = reference(name, MODELS[name], steps=0)["params"]
        expected = reference_mixed(name, MODELS[name], dtype, 3, 4, clip=c.get("clip"), device="cuda",
                                   loss_scale=FP16_SCALE if dtype == torch.float16 else 1.0)
        # frozen parameters are stored (and gathered back) in the low dtype, like DeepSpeed's; a
        # trainable one no gradient reached (external's gate.0.bias) keeps its fp32 master exactly
        frozen = {k for k, p in build(name, **MODELS[name]).named_parameters() if not p.requires_grad}
        for k in frozen:
            assert torch.equal(gpu["params"][k], init[k].to(dtype).float()), k
        untouched = {k for k, v in expected["params"].items() if k not in frozen and torch.equal(v, init[k])}
        for k in untouched:
            assert torch.equal(gpu["params"][k], init[k]) and torch.equal(cpu["params"][k], init[k]), k
        trained = {k: v for k, v in expected["params"].items() if k not in frozen | untouched}
        assert_within_roundoff(gpu["params"], trained, init, UNIT_ROUNDOFF[dtype], False)
        assert_within_roundoff(gpu["params"], {k: cpu["params"][k] for k in trained}, init, UNIT_ROUNDOFF[dtype], False)


@pytest.mark.parametrize("composition", ["zero1", "zero3"])
def test_checkpoints_move_between_gpu_and_cpu_states_at_other_world_sizes(composition, tmp_path):
    """Saved by two CPU ranks, loaded by one GPU rank and trained on; saved by that GPU rank,
    loaded by three CPU ranks: each equals plain PyTorch trained without a break."""
    how = COMPOSITIONS[composition]
    expected = {n: reference("gpt", {}, steps=n, batch_size=GLOBAL_BATCH)["params"] for n in (2, 5, 8)}
    workers(2).run(train_then_save, "gpt", how, 2, str(tmp_path / "cpu"))
    (r,) = workers(1, "nccl").run(load_then_train, "gpt", how, 2, 3, str(tmp_path / "cpu"), None, "cuda")
    assert r["devices"] == ["cuda:0"] and r["count"] == 5
    assert_close_to(r["params"], expected[5])
    (saved,) = workers(1, "nccl").run(train_then_save, "gpt", how, 5, str(tmp_path / "gpu"), "cuda")
    assert_close_to(saved["params"], expected[5])
    for r in workers(3).run(load_then_train, "gpt", how, 5, 3, str(tmp_path / "gpu")):
        assert r["manifest_world"] == 1 and r["count"] == 8
        assert_close_to(r["params"], expected[8])


def cuda_adam_calls_in_two_steps() -> tuple[int, str]:
    """Two zero3 + bf16 steps on the GPU with the CUDA Adam module spied on: how often its
    kernel ran (-1: not built here) and, if not built, why."""
    from zfunc.ops import builder, cuda_adam

    module = cuda_adam.load()
    if module is None:
        return -1, next(r["reason"] for r in builder.report() if r["name"] == cuda_adam.NAME)
    calls = []

    class Spy:
        def adam_update(self, *args, **kw):
            calls.append(len(args[0]))
            return module.adam_update(*args, **kw)

    real, cuda_adam.load = cuda_adam.load, lambda: Spy()
    try:
        run_composed("gpt", {}, 3, steps=2, precision={"dtype": torch.bfloat16}, device="cuda")
    finally:
        cuda_adam.load = real
    return len(calls), ""


def test_the_update_of_gpu_states_runs_the_cuda_adam_kernel():
    ((calls, why),) = workers(1, "nccl").run(cuda_adam_calls_in_two_steps)
    assert calls != -1, f"the CUDA Adam kernel did not build: {why}"
    assert calls >= 2, calls  # at least one launch per update


def built_on_the_cpu_made_on_the_gpu() -> dict:
    import transformers
    import zfunc as zf
    from hf import llama_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(  # on the CPU, rotary buffers too
        llama_config(vocab_size=64, hidden_size=32, intermediate_size=64))
    plain = copy.deepcopy(model).cuda()

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    state = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3))).init(model, device="cuda")
    x = torch.randint(0, 64, (2, 8), device="cuda")
    devices = {str(t.device) for t in [*state.params.leaves, *state.buffers.values()]}
    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    return {"devices": devices, "loss": float(plain(input_ids=x, labels=x).loss), "zfunc": float(step(state, x)[1]["loss"])}


def test_a_model_built_on_the_cpu_is_made_on_the_gpu_asked_for():
    """``step.init(model, device="cuda")`` on a model built on the CPU copies it there unit by unit,
    buffers too (it once kept the model's own device, and the first forward failed)."""
    ((r,),) = [workers(1, "nccl").run(built_on_the_cpu_made_on_the_gpu)]
    assert r["devices"] == {"cuda:0"}, r["devices"]
    assert abs(r["zfunc"] - r["loss"]) < 1e-5, r


SHARED = ["zero1", "zero2", "zero3", "zero3-bf16", "zero3-offload_cpu", "zero3-offload_nvme"]


@pytest.mark.parametrize("composition", SHARED)
def test_two_ranks_share_one_gpu_over_gloo(composition, tmp_path):
    """W = 2 on the one GPU these machines have: nccl refuses two ranks on one device, so the
    ranks talk over gloo, which carries CUDA tensors for the collectives zfunc uses; the states
    live on the GPU, and two ranks equal the same composition on two CPU ranks (and, in fp32,
    plain PyTorch on the global batch)."""
    c = COMPOSITIONS[composition]
    offload = c.get("offload")
    runs = {}
    for device in ("cuda", "cpu"):
        if offload is not None and offload["kind"] == "nvme":
            offload = {**offload, "path": str(tmp_path / device)}
        runs[device] = workers(2).run(run_composed, "gpt", {}, c["stage"], 3, 4, 0, c.get("precision"), None, None,
                                      False, None, False, None, offload, None, device)
    home = "meta" if offload is not None and offload["kind"] == "nvme" else "cuda:0"
    for gpu, cpu in zip(runs["cuda"], runs["cpu"]):
        assert gpu["devices"] == [home], gpu["devices"]
        if c.get("precision") is None:
            assert_close_to(gpu["params"], cpu["params"])
        else:
            init = reference("gpt", {}, steps=0)["params"]
            assert_within_roundoff(gpu["params"], cpu["params"], init, UNIT_ROUNDOFF[c["precision"]["dtype"]], False)
    if c.get("precision") is None:
        expected = reference("gpt", {}, steps=3, batch_size=8, device="cuda")
        assert_close_to(runs["cuda"][0]["params"], expected["params"])


OVERLAPPED = ["zero3-offload_cpu", "zero3-bf16-offload_cpu", "zero3-offload_params_cpu", "zero3-bf16-offload_cpu-split",
              "zero3-bf16-accumulate-offload_cpu"]
# accumulate_on="host" runs its update after backward: with the update behind the next forward it differed
# from the synchronous one on an H200 (run 5), so offload_cpu refuses the pair


@pytest.mark.parametrize("composition", OVERLAPPED)
def test_the_update_behind_the_next_forward_equals_it_after_backward_on_cuda(composition):
    """offload_cpu's host update on its worker thread, uploads on a side stream, the next forward
    waiting per unit (the state not read between steps, so each forward overlaps the update):
    bit for bit the update after backward, the same kernels on the same values."""
    c = COMPOSITIONS[composition]
    runs = {}
    for overlap in (False, True):
        (runs[overlap],) = workers(1, "nccl").run(
            run_composed, "gpt", {}, c["stage"], 4, 4, 0, c.get("precision"), c.get("micro"), c.get("clip"), False,
            None, False, None, {**c["offload"], "overlap": overlap}, None, "cuda", False)
    a, b = runs[False], runs[True]
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
