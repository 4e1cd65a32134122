"""Hugging Face ``transformers`` models built from a config (no download), trained with
activation checkpointing under every ZeRO stage, equal plain PyTorch (AdamW defaults).

GPT-2 ties its LM head to the token embedding and reads ``wte.weight`` outside the
embedding's forward; Llama adds rotary embeddings, RMSNorm and grouped-query attention."""
import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from fp32_masters import master_step
from workers import workers

transformers = pytest.importorskip("transformers")  # the [test] extra installs it
from hf import gpt2_config, llama_config  # noqa: E402
STEPS = 3


def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(gpt2_config())
    return transformers.LlamaForCausalLM(llama_config())


def tokens(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, 50, (size, 8), generator=torch.Generator().manual_seed(step))


def reference(kind: str, batch_size: int) -> dict:
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(STEPS):
        x = tokens(i, batch_size)
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def checkpointed(kind: str):
    """The model with activation checkpointing, and its loss through zf.apply."""
    model = build(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    return model, loss_fn


def run(kind: str, stage: int, per_rank: int, offload: dict | None = None, compile: str | None = None) -> dict:
    """``offload``: ``{"kind": "cpu" | "nvme", **keywords}`` inside the stage. ``compile``: the
    decoder layers compiled (``"blocks"``, zf.compile_units) or the step (``"jit"``, and with
    ``"regather"`` gathering again in backward), aot_eager."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, loss_fn = checkpointed(kind)
    torch._dynamo.reset()
    if compile == "blocks":
        zf.compile_units(model, backend="aot_eager")

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    if offload is not None:
        kw = dict(offload)
        step = getattr(zf, "offload_" + kw.pop("kind"))(step, **kw)
    step = {0: lambda s: s, 1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step)
    if compile in ("jit", "regather"):
        step = zf.jit(step, backend="aot_eager", regather=compile == "regather")
    with step.init(model) as state:
        for i in range(STEPS):
            state, _ = step(state, tokens(i, per_rank * world)[rank * per_rank : (rank + 1) * per_rank])
        return zf.gather_params(state)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_matches_pytorch(kind, world):
    expected = reference(kind, 2 * world)
    for stage in (0, 1, 2, 3):
        for got in workers(world).run(run, kind, stage, 2):
            assert_close_to(got, expected)


@pytest.mark.parametrize("compile", ["blocks", pytest.param("jit", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_compiled_matches_pytorch(kind, compile):
    """Decoder layers compiled (with Hugging Face's activation checkpointing), or the step, under zero3 at W = 2."""
    expected = reference(kind, 4)
    for got in workers(2).run(run, kind, 3, 2, None, compile):
        assert_close_to(got, expected)


def run_regathered(kind: str, checkpointing: bool) -> dict:
    """zf.jit(zero3, regather=True) at W = 2 on the model with or without Hugging Face's checkpointing."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(kind)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    step = zf.jit(zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss,
                                         zf.optim.adamw(1e-3))), backend="aot_eager", regather=True)
    state = step.init(model)
    try:
        for i in range(STEPS):
            state, _ = step(state, tokens(i, 2 * world)[rank * 2 : (rank + 1) * 2])
    except zf.CompileError as e:
        return {"error": str(e)}
    return {"params": zf.gather_params(state)}


@pytest.mark.slow  # the fast tier trains gpt2 against PyTorch in test_transformers_model_matches_pytorch
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_regathered_matches_pytorch(kind):
    """zf.jit(regather=True) re-gathers in backward through its own checkpoint. Hugging Face's
    checkpointing inside it stays in the program for Llama; GPT-2's is left to eager autograd,
    whose recomputation would read weights outside the program: refused, naming both."""
    expected = reference(kind, 4)
    for got in workers(2).run(run_regathered, kind, False):
        assert_close_to(got["params"], expected)
    # torch 2.11's dynamo leaves Llama's checkpoint to eager autograd too: the same clear refusal
    program_keeps_llamas = torch.__version__ >= (2, 13)
    for got in workers(2).run(run_regathered, kind, True):
        if kind == "llama" and (program_keeps_llamas or "params" in got):
            assert_close_to(got["params"], expected)
        else:
            assert "regather=True" in got["error"] and "gradient_checkpointing_enable" in got["error"], got


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_offloaded_matches_pytorch(kind, tmp_path):
    """With activation checkpointing, under zero3(offload_nvme), zero2(offload_nvme(params=False))
    (one unit per sub-group, so most of the state streams from disk) and zero3(offload_cpu)."""
    expected = reference(kind, 4)
    nvme = {"kind": "nvme", "path": str(tmp_path), "sub_group_size": 1}
    for stage, offload in ((3, nvme), (2, dict(nvme, params=False)), (3, {"kind": "cpu"})):
        for got in workers(2).run(run, kind, stage, 2, offload):
            assert_close_to(got, expected)


def reference_bf16(kind: str, batch_size: int) -> tuple[dict, dict]:
    """Plain PyTorch bf16: a module copy cast to bf16 runs forward/backward, fp32 SGD on a master."""
    master = build(kind)
    init = {k: v.detach().clone() for k, v in master.named_parameters()}
    low = build(kind).to(torch.bfloat16)
    opt = torch.optim.SGD(master.parameters(), lr=1e-2)
    for i in range(STEPS):
        x = tokens(i, batch_size)
        low.zero_grad(set_to_none=True)
        low(input_ids=x, labels=x).loss.backward()
        master_step(master, low, opt)
    return {k: v.detach().clone() for k, v in master.named_parameters()}, init


def run_bf16(kind: str, per_rank: int, micro: int) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, loss_fn = checkpointed(kind)

    step = zf.zero3(zf.accumulate(zf.mixed_precision(zf.train_step(loss_fn, zf.optim.sgd(1e-2)), torch.bfloat16), micro))
    state = step.init(model)
    for i in range(STEPS):
        mine = tokens(i, per_rank * world)[rank * per_rank : (rank + 1) * per_rank]
        state, _ = step(state, list(mine.chunk(micro)))
    return zf.gather_params(state)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_in_bf16_with_accumulation(kind):
    """zero3(accumulate(mixed_precision(bf16), 2)) at W = 2 with activation checkpointing: every
    parameter within 16 u (bf16 u = 2^-8) of its tensor's largest move from plain PyTorch bf16
    with an fp32 master (SGD, linear in the gradients; see test_precision)."""
    expected, init = reference_bf16(kind, 4)
    for got in workers(2).run(run_bf16, kind, 2, 2):
        for k, want in expected.items():
            move = (want - init[k]).abs().max().item()
            assert (got[k] - want).abs().max().item() <= 16 * 2.0 ** -8 * move, k


def test_llama_keeps_its_rotary_frequencies_in_fp32():
    """keep= leaves named buffers in their own dtype under buffer_dtype=bf16: Llama's rotary inv_freq, which
    Hugging Face reads in fp32 on purpose, stays fp32 and bit for bit the model's."""
    model = build("llama")
    want = {k: v.clone() for k, v in model.named_buffers() if k.endswith("inv_freq")}
    assert want

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), torch.bfloat16,
                              buffer_dtype=torch.bfloat16, keep=lambda name: name.endswith("inv_freq"))
    state = step.init(model)
    state, metrics = step(state, tokens(0, 2))
    assert torch.isfinite(metrics["loss"])
    for k, v in want.items():
        assert state.buffers[k].dtype == torch.float32 and torch.equal(state.buffers[k], v)
    assert all(t.dtype == torch.bfloat16 for t in state.params.leaves)
