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
import copy

import pytest
import torch

from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from cases import reference, reference_mixed, run_composed
from compositions import FP16_SCALE
from fp32_masters import master_step
from models import DEEP_MLP as MLP, build
from workers import workers

MODELS = {"gpt": {}, "deep_mlp": MLP}


def _prec(dtype):
    return {"dtype": dtype} | ({"loss_scale": FP16_SCALE} if dtype == torch.float16 else {})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
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
                assert_within_roundoff(r["params"], ref["params"], init, UNIT_ROUNDOFF[dtype], sgd)
                # the loss is computed in the dtype: a few roundings of u apart, as the gradients
                assert [h["loss"] for h in r["history"]] == pytest.approx(ref["losses"], rel=16 * UNIT_ROUNDOFF[dtype])
                assert not any(h["skipped"] for h in r["history"])


def test_bf16_reduce_dtype_and_clipping():
    """Reducing in bf16 (DeepSpeed's way) and clipping the unscaled norm stay within the bounds."""
    kw = MODELS["deep_mlp"]
    init = reference("deep_mlp", kw, steps=0)["params"]
    ref = reference_mixed("deep_mlp", kw, torch.bfloat16, 3, 8, sgd=True, clip=0.05)
    for stage in (1, 3):
        prec = {"dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}
        for r in workers(2).run(run_composed, "deep_mlp", kw, stage, 3, 4, 0, prec, None, 0.05, False, None, True):
            assert_within_roundoff(r["params"], ref["params"], init, UNIT_ROUNDOFF[torch.bfloat16], True)
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
    """frozen_bn under bf16 with ``buffer_dtype=bf16`` (its forward adds a buffer to activations and runs
    BatchNorm, so it needs its buffers in the compute dtype): its frozen weight, fixed shift and BatchNorm
    statistics follow the dtype."""
    import zfunc as zf
    from cases import _setup
    from models import batch, local, loss

    rank, world, model, shape_model, _ = _setup("frozen_bn", {}, 0)
    frozen_before = model.blocks[0][0].weight.detach().clone()

    def loss_fn(params, b):
        return loss("frozen_bn", zf.apply(model, params, b[0]), b[1])

    step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), torch.bfloat16,
                              buffer_dtype=torch.bfloat16)
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
def test_frozen_parameters_and_buffers_follow_buffer_dtype(stage):
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
            assert_within_roundoff(r["params"], ref["params"], init, UNIT_ROUNDOFF[torch.float16], True)
            assert all(0.05 < h["grad_norm"] < 100 for h in r["history"])  # unscaled, and clipped


# Hugging Face models whose buffers a bf16 copy would round: rotary frequencies (all), Gemma's
# embedding scale. Built from a config, small, no download.
HF_SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, head_dim=8, bos_token_id=0, eos_token_id=0,
                pad_token_id=0)
HF_FAMILIES = ["llama", "gemma2", "gpt_neox"] + [pytest.param(k, marks=pytest.mark.slow)
                                                for k in ("qwen2", "qwen3", "phi", "granite", "starcoder2")]
HF_LR = 0.05


def _hf(kind: str):
    import transformers  # the test extra

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, **HF_SMALL)
    cfg.use_cache = False
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _tokens(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, 64, (size, 12), generator=torch.Generator().manual_seed(step))


def hf_reference_bf16(kind: str, steps: int, batch_size: int) -> tuple[dict, list, dict]:
    """Plain PyTorch as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) runs: a copy whose
    parameters (only) are bf16, buffers in their own dtype; fp32 SGD on a master copy."""
    master = _hf(kind)
    low = copy.deepcopy(master)
    for p in low.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert all(b.dtype == torch.float32 for b in low.buffers())
    opt = torch.optim.SGD(master.parameters(), lr=HF_LR)
    losses = []
    for i in range(steps):
        x = _tokens(i, batch_size)
        low.zero_grad(set_to_none=True)
        value = low(input_ids=x, labels=x).loss
        value.backward()
        master_step(master, low, opt)
        losses.append(value.item())
    return {k: v.detach().clone() for k, v in master.named_parameters()}, losses, dict(low.named_buffers())


def hf_bf16(kind: str, stage: int, steps: int, per_rank: int) -> dict:
    """zeroN(mixed_precision(train_step, bf16)) with the default buffer_dtype, on this rank's part."""
    import zfunc as zf

    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = _hf(kind)
    before = {k: v.clone() for k, v in model.named_buffers()}

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.sgd(HF_LR)), torch.bfloat16)
    step = {0: step, 1: zf.zero1(step), 2: zf.zero2(step), 3: zf.zero3(step)}[stage]
    state = step.init(model)
    losses = []
    for i in range(steps):
        state, metrics = step(state, _tokens(i, per_rank * world)[rank * per_rank:(rank + 1) * per_rank])
        losses.append(float(metrics["loss"]))
    return {"params": zf.gather_params(state), "losses": losses, "before": before,
            "buffers": {k: v.clone() for k, v in state.buffers.items()},
            "dtypes": sorted({str(t.dtype) for t in state.params.leaves})}


def _buffers_bit_for_bit(got: dict, want: dict) -> None:
    assert set(got) == set(want) and want
    for k, v in want.items():
        assert got[k].dtype == v.dtype == torch.float32, (k, got[k].dtype)
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("kind", HF_FAMILIES)
def test_buffers_keep_their_dtype_by_default(kind):
    """As FSDP2's MixedPrecisionPolicy and autocast: under bf16 the parameters are bf16, every buffer
    (rotary inv_freq, Gemma's embed_scale) stays fp32 and bit for bit the model's, and a step trains
    as plain PyTorch with bf16 parameters and fp32 buffers does."""
    ref, ref_losses, ref_buffers = hf_reference_bf16(kind, 2, 4)
    (r,) = workers(1).run(hf_bf16, kind, 0, 2, 4)
    assert r["dtypes"] == ["torch.bfloat16"]
    _buffers_bit_for_bit(r["buffers"], r["before"])
    _buffers_bit_for_bit(r["buffers"], ref_buffers)
    assert_within_roundoff(r["params"], ref, reference_hf_init(kind), UNIT_ROUNDOFF[torch.bfloat16], True)
    assert r["losses"] == pytest.approx(ref_losses, rel=16 * UNIT_ROUNDOFF[torch.bfloat16])


def reference_hf_init(kind: str) -> dict:
    return {k: v.detach().clone() for k, v in _hf(kind).named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_buffers_keep_their_dtype_under_zero_at_w2(kind):
    """The same at W = 2 under zero1 and zero3: the buffers are broadcast and kept, not cast."""
    ref, ref_losses, ref_buffers = hf_reference_bf16(kind, 2, 4)
    init = reference_hf_init(kind)
    for stage in (1, 3):
        for r in workers(2).run(hf_bf16, kind, stage, 2, 2):
            _buffers_bit_for_bit(r["buffers"], ref_buffers)
            assert_within_roundoff(r["params"], ref, init, UNIT_ROUNDOFF[torch.bfloat16], True)
            assert r["losses"] == pytest.approx(ref_losses, rel=16 * UNIT_ROUNDOFF[torch.bfloat16])


def test_keep_and_buffer_dtype():
    """``buffer_dtype=bf16`` casts the floating buffers, except those ``keep`` names; bad values are named."""
    import zfunc as zf

    model = _hf("llama")
    want = dict(model.named_buffers())

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    base = zf.train_step(loss_fn, zf.optim.sgd(HF_LR))
    cast = zf.mixed_precision(base, torch.bfloat16, buffer_dtype=torch.bfloat16).init(model, free_model=False)
    assert {k: v.dtype for k, v in cast.buffers.items()} == {k: torch.bfloat16 for k in want}
    kept = zf.mixed_precision(base, torch.bfloat16, buffer_dtype=torch.bfloat16,
                              keep=lambda n: n.endswith(".inv_freq")).init(model, free_model=False)
    for k, v in kept.buffers.items():
        assert v.dtype == (torch.float32 if k.endswith(".inv_freq") else torch.bfloat16), k
    assert "buffer_dtype=bfloat16" in zf.mixed_precision(base, torch.bfloat16, buffer_dtype=torch.bfloat16).composition
    with pytest.raises(ValueError, match="buffer_dtype must be None"):
        zf.mixed_precision(base, torch.bfloat16, buffer_dtype=torch.int64)


def test_deepspeed_config_bf16_keeps_buffers():
    """zf.initialize with ``bf16: {enabled: true}`` composes mixed_precision with the same default."""
    import zfunc as zf

    model = _hf("llama")
    want = {k: v.clone() for k, v in model.named_buffers()}
    config = {"train_batch_size": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": HF_LR}}}
    engine = zf.initialize(model, config, loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    try:
        engine.train_batch(iter([_tokens(0, 2)]))
        assert all(t.dtype == torch.bfloat16 for t in engine.state.params.leaves)
        _buffers_bit_for_bit(dict(engine.state.buffers), want)
    finally:
        engine.close()
