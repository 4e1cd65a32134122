"""zf.mixed_precision: bf16/fp16 compute with fp32 master weights equals plain PyTorch doing
the same (a module copy cast to the dtype runs forward and backward on the global batch,
fp32 AdamW/SGD updates a master copy), for every ZeRO stage at W = 1, 2, 3.

Tolerances, from the dtype's unit roundoff u (bf16 2^-8, fp16 2^-11). A gradient computed
in the dtype carries a few roundings of relative size u (activations, the backward, the
reduced mean stored in the dtype), and ranks split the batch where the reference does not,
so the two gradients differ by a small multiple of u times their size.

* SGD is linear in the gradients: every parameter within 16 u of the largest distance any
  element of its tensor moved (the roundings of a few layers, with room).
* Adam divides each gradient by its own running size, so an element whose gradient is
  below its rounding noise can take its step of about lr in the other direction. So: no
  element further off than the largest step (a flipped step, not a wrong update), and at
  least 90% of all elements within 4 u of it.
"""
import pytest
import torch

from cases import reference, reference_mixed, run_composed
from models import build
from test_zero_equivalence import assert_close_to
from workers import workers

U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
MLP = {"d_in": 5, "width": 16, "depth": 3, "d_out": 3}
MODELS = {"gpt": {}, "deep_mlp": MLP}
FP16_SCALE = 1024.0  # fixed, so the reference scales the same way


def _prec(dtype):
    return {"dtype": dtype} | ({"loss_scale": FP16_SCALE} if dtype == torch.float16 else {})


def _check(got: dict, ref: dict, init: dict, u: float, sgd: bool):
    close, total = 0, 0
    for k, want in ref.items():
        err = (got[k] - want).abs()
        move = (want - init[k]).abs().max().item()
        if sgd:
            assert err.max().item() <= 16 * u * move, f"{k}: off by {err.max().item():.3g}, bound {16 * u * move:.3g}"
        else:
            assert err.max().item() <= move, f"{k}: off by {err.max().item():.3g}, more than its largest step {move:.3g}"
            close += int((err <= 4 * u * move).sum())
            total += err.numel()
    if not sgd:
        assert close >= 0.9 * total, f"only {close} of {total} elements within 4u of the reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_pytorch_mixed_precision(name, world, dtype):
    kw = MODELS[name]
    init = reference(name, kw, steps=0)["params"]
    scale = FP16_SCALE if dtype == torch.float16 else 1.0
    for sgd in (False, True):
        ref = reference_mixed(name, kw, dtype, 3, 4 * world, loss_scale=scale, sgd=sgd)
        for stage in (0, 1, 2, 3):
            for r in workers(world).run(run_composed, name, kw, stage, 3, 4, 0, _prec(dtype), None, None, False, None, sgd):
                assert r["dtypes"] == [str(dtype)]
                _check(r["params"], ref["params"], init, U[dtype], sgd)
                # the loss is computed in the dtype: a few roundings of u apart, as the gradients
                assert [h["loss"] for h in r["history"]] == pytest.approx(ref["losses"], rel=16 * U[dtype])
                assert not any(h["skipped"] for h in r["history"])


def test_bf16_reduce_dtype_and_clipping():
    """Reducing in bf16 (DeepSpeed's way) and clipping the unscaled norm stay within the bounds."""
    kw = MODELS["deep_mlp"]
    init = reference("deep_mlp", kw, steps=0)["params"]
    ref = reference_mixed("deep_mlp", kw, torch.bfloat16, 3, 8, sgd=True, clip=0.05)
    for stage in (1, 3):
        prec = {"dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}
        for r in workers(2).run(run_composed, "deep_mlp", kw, stage, 3, 4, 0, prec, None, 0.05, False, None, True):
            _check(r["params"], ref["params"], init, U[torch.bfloat16], True)
            assert all(h["grad_norm"] > 0.05 for h in r["history"])  # the clip was active


def test_fp32_unchanged_without_mixed_precision():
    expected = reference("gpt", {}, steps=3, batch_size=8)
    for r in workers(2).run(run_composed, "gpt", {}, 3, 3, 4):
        assert r["dtypes"] == ["torch.float32"]
        assert_close_to(r["params"], expected["params"])


P = G = 2  # bf16 parameters and gradients
K = 12  # fp32 master, exp_avg, exp_avg_sq


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_zero_formulas(stage, world):
    kw = {"d_in": 5, "width": 23, "depth": 4, "d_out": 3}
    formula = {0: (P + G + K), 1: (P + G) + K / world, 2: P + (G + K) / world, 3: (P + G + K) / world}[stage]
    for r in workers(world).run(run_composed, "deep_mlp", kw, stage, 1, 2, 0, {"dtype": torch.bfloat16}):
        psi = sum(padded for _, _, padded in r["units"])  # parameters plus the padding to a multiple of W
        held = r["memory"]["param_bytes"] + r["history"][-1]["grad_bytes"] + r["memory"]["optimizer_bytes"]
        # AdamW's int64 step count per parameter, and its update count
        counters = 8 * (sum(p.requires_grad for p in build("deep_mlp", **kw).parameters()) + 1)
        assert held == formula * psi + counters



def frozen_and_buffers_bf16(stage: int) -> dict:
    """frozen_bn under bf16: its frozen weight, fixed shift and BatchNorm statistics follow the dtype."""
    import zfunc as zf
    from cases import _setup
    from models import batch, local, loss

    rank, world, model, shape_model, _ = _setup("frozen_bn", {}, 0)
    frozen_before = model.blocks[0][0].weight.detach().clone()

    def loss_fn(params, b):
        return loss("frozen_bn", zf.apply(model, params, b[0]), b[1])

    step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), torch.bfloat16)
    step = {0: step, 1: zf.zero1(step), 2: zf.zero2(step), 3: zf.zero3(step)}[stage]
    state = step.init(model)
    for i in range(2):
        state, _ = step(state, local(batch("frozen_bn", shape_model, i, 4 * world), rank, world))
    return {"buffers": {k: str(v.dtype) for k, v in state.buffers.items()},
            "frozen": [str(t.dtype) for t in state.frozen.leaves if t.numel()],
            "frozen_same": torch.equal(zf.gather_params(state)["blocks.0.0.weight"],
                                       frozen_before.to(torch.bfloat16).float()),
            "means": state.buffers["blocks.0.1.running_mean"].abs().sum().item()}


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_parameters_and_buffers_follow_the_dtype(stage):
    for r in workers(2).run(frozen_and_buffers_bf16, stage):
        assert r["buffers"]["blocks.0.1.running_mean"] == "torch.bfloat16"
        assert r["buffers"]["blocks.0.1.num_batches_tracked"] == "torch.int64"
        assert r["buffers"]["shift"] == "torch.bfloat16"
        assert r["frozen"] == ["torch.bfloat16"]
        assert r["frozen_same"] and r["means"] > 0  # never updated; statistics were


def test_fp16_clipping_sees_unscaled_gradients():
    """Under a loss scale of 1024 the clip must act on the true norm: a clip the scaled
    norm would trip 1024 times harder leaves the result equal to the reference's."""
    kw = MODELS["deep_mlp"]
    init = reference("deep_mlp", kw, steps=0)["params"]
    ref = reference_mixed("deep_mlp", kw, torch.float16, 3, 8, loss_scale=FP16_SCALE, sgd=True, clip=0.05)
    for stage in (0, 2):
        for r in workers(2).run(run_composed, "deep_mlp", kw, stage, 3, 4, 0, _prec(torch.float16), None, 0.05,
                                False, None, True):
            _check(r["params"], ref["params"], init, U[torch.float16], True)
            assert all(0.05 < h["grad_norm"] < 100 for h in r["history"])  # unscaled, and clipped
