"""zf.recompute: each unit's activations recomputed in backward. Equal to plain PyTorch with
torch.utils.checkpoint around the same blocks (fp32, relative 1e-5) under every stage, clipping,
accumulation and offload; bit for bit the same step without it under every composition of
tests/harness/compositions.py (precision too); backward runs each unit again; only the unit
boundaries are saved; where it may go and what it refuses."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from assertions import assert_close_to
from compositions import COMPOSITIONS
from models import MODEL_KW, batch, build
from recompute import checkpoint_units, count_calls, reference, run, unit_modules
from workers import workers

FP32 = [n for n, c in COMPOSITIONS.items() if "precision" not in c]
FAST_FP32 = ["zero0", "zero3", "zero3-clip", "zero2-accumulate", "zero3-offload_cpu", "zero3-offload_nvme"]
LOW = [n for n in COMPOSITIONS if n not in FP32]
FAST_LOW = ["zero3-bf16-accumulate-offload_cpu", "zero1-fp16"]


def _slow_unless(names):
    return lambda n: n if n in names else pytest.param(n, marks=pytest.mark.slow)


def _runs_again(plain: dict, recomputed: dict, model: nn.Module) -> None:
    """Each leaf module inside a unit ran twice as often as without recomputation (forward, then
    backward again), the root's as often."""
    inside = tuple(p + "." for p in unit_modules(model))
    assert plain.keys() == recomputed.keys()
    for path, n in plain.items():
        assert recomputed[path] == (2 * n if path.startswith(inside) else n), (path, n, recomputed[path])


@pytest.mark.parametrize("composition", [_slow_unless(FAST_FP32)(n) for n in FP32])
def test_equals_plain_pytorch_with_checkpointed_blocks(composition, tmp_path):
    """fp32 at W = 2: parameters and losses within 1e-5 of plain PyTorch whose blocks run under
    checkpoint(..., use_reentrant=False), for models with a tied head, user checkpointing of their
    own, weights read outside their unit."""
    spec = COMPOSITIONS[composition]
    for name in ("deep_mlp", "checkpointed", "external"):
        kw = MODEL_KW[name]
        expected = reference(name, kw, steps=3, batch_size=4, clip=spec.get("clip"))
        for r in workers(2).run(run, name, kw, composition, True, 3, 2, 0, str(tmp_path)):
            assert r["composition"].startswith("recompute(")
            assert_close_to(r["params"], expected["params"])
            assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)
            # backward ran what plain PyTorch's checkpoints run again, once a micro-batch
            assert r["calls"] == {k: n * spec.get("micro", 1) for k, n in expected["calls"].items()}


@pytest.mark.parametrize("composition", [_slow_unless(FAST_LOW + ["zero3-offload_nvme", "zero2-accumulate"])(n)
                                         for n in COMPOSITIONS])
def test_bit_for_bit_the_step_without_it(composition, tmp_path):
    """Recomputation changes no arithmetic: every composition (bf16, fp16's loss scale, offload to
    CPU and NVMe, accumulation) gives the parameters and losses of the same step without it, bit for
    bit, at W = 2; recompute innermost here (the previous test puts it outermost)."""
    kw = MODEL_KW["deep_mlp"]
    where = "outer" if "clip" in COMPOSITIONS[composition] else "inner"
    plain = workers(2).run(run, "deep_mlp", kw, composition, False, 2, 2, 0, str(tmp_path))
    again = workers(2).run(run, "deep_mlp", kw, composition, True, 2, 2, 0, str(tmp_path), where)
    for a, b in zip(plain, again):
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert a["losses"] == b["losses"]
        _runs_again(a["calls"], b["calls"], build("deep_mlp", **kw))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "reusing"])
def test_equals_plain_pytorch_for_more_models(name):
    """A GPT with a tied head, blocks applied thrice a forward: zero3 at W = 2."""
    kw = MODEL_KW.get(name, {})
    expected = reference(name, kw, steps=3, batch_size=4)
    for r in workers(2).run(run, name, kw, "zero3", True, 3, 2):
        assert_close_to(r["params"], expected["params"])
        assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert r["calls"] == expected["calls"]


# ------------------------------------------------------------------ what backward keeps


class Chain(nn.Module):
    """Blocks whose outputs the root's tanh saves: with recomputation, the unit boundaries are all
    autograd keeps."""

    def __init__(self, d: int = 8, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _saved_bytes(run_model):
    """Bytes of the distinct tensors autograd saves while ``run_model()`` runs (a tensor saved twice,
    as a block's output that the next block's checkpoint keeps as its input, counted once), and
    what ``run_model`` returned."""
    saved = {}

    def pack(t):
        saved[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_model()
    return sum(saved.values()), out


@pytest.mark.parametrize("recompute", [False, True])
def test_only_the_unit_boundaries_are_saved(recompute):
    """Counted with saved_tensors_hooks around zf.apply: without recomputation the blocks' inputs,
    GELU's and the weights are saved, as plain PyTorch saves them; with it only the unit
    boundaries, each block's input and the last one's output (B x d floats each), as plain PyTorch
    with checkpointed blocks. The step's result is plain PyTorch's either way."""
    torch.manual_seed(0)
    b, d, depth = 16, 8, 3
    model, plain = Chain(d, depth), Chain(d, depth)
    plain.load_state_dict(model.state_dict())
    if recompute:
        checkpoint_units(plain)
    x = torch.randn(b, d)
    counted = {}

    def loss_fn(params, x):
        counted["bytes"], out = _saved_bytes(lambda: zf.apply(model, params, x))
        return out.square().mean()

    step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    step = zf.recompute(step) if recompute else step
    state = step.init(model)
    state, metrics = step(state, x)
    expected, out = _saved_bytes(lambda: plain(x))
    assert counted["bytes"] == expected
    boundaries = (depth + 1) * b * d * 4
    if recompute:
        assert expected == boundaries
    else:  # GELU's input and output (B x 4d each) in every block, at least
        assert expected > boundaries + depth * 2 * b * 4 * d * 4
    out.square().mean().backward()
    assert_close_to(zf.gather_params(state), {k: p - 0.1 * p.grad for k, p in plain.named_parameters()})


# ------------------------------------------------------------------ choice of units, composition


def test_units_chooses_which_blocks_and_the_root_runs_once():
    """units=[names] or a predicate: only those blocks run again in backward; the state is the
    same with or without recompute (shapes_state is False), so one state serves both steps."""
    name, kw = "deep_mlp", MODEL_KW["deep_mlp"]
    model = build(name, **kw)
    calls = {}
    for i, block in enumerate(model.blocks):
        calls[i] = 0
        block[1].register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))

    def loss_fn(params, b):
        return F.mse_loss(zf.apply(model, params, b[0]), b[1])

    base = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    every_other = zf.zero3(zf.recompute(zf.train_step(loss_fn, zf.optim.adamw(1e-3)),
                                        units=lambda n, m: n in ("blocks.0", "blocks.2")))
    named = zf.zero3(zf.recompute(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), units=["blocks.1"]))
    assert every_other.composition == "zero3(recompute(train_step, <lambda>))"
    assert named.composition == "zero3(recompute(train_step, ['blocks.1']))"
    state = base.init(model)
    shape = build(name, **kw)
    for step, twice in ((every_other, {0, 2}), (named, {1}), (base, set())):
        for i in calls:
            calls[i] = 0
        state, _ = step(state, batch(name, shape, 0, 4))
        assert calls == {i: 2 if i in twice else 1 for i in calls}


def test_anywhere_once_and_not_under_jit():
    f = zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1))
    assert zf.zero3(zf.recompute(zf.offload_cpu(f))).composition == "zero3(recompute(offload_cpu(train_step)))"
    assert zf.recompute(zf.zero2(f)).composition == "recompute(zero2(train_step))"
    with pytest.raises(ValueError, match="already applied"):
        zf.recompute(zf.zero3(zf.recompute(f)))
    with pytest.raises(TypeError, match="unit names or a predicate"):
        zf.recompute(f, units=[0, 1])
    with pytest.raises(TypeError, match="transforms a zfunc Step"):
        zf.recompute(lambda s, b: s)
    model = build("deep_mlp", **MODEL_KW["deep_mlp"])
    step = zf.jit(zf.recompute(zf.train_step(lambda p, b: zf.apply(model, p, b).sum(), zf.optim.sgd(0.1))))
    state = step.init(model)
    with pytest.raises(ValueError, match="cannot recompute units eagerly"):
        step(state, torch.randn(2, MODEL_KW["deep_mlp"]["d_in"]))


def test_eval_step_and_no_grad_run_plain_and_forward_comes_back():
    """An eval step of a recomputed train step's state runs no checkpoint; after a step the
    model's modules have their own forward again."""
    kw = MODEL_KW["deep_mlp"]
    model = build("deep_mlp", **kw)
    own = [type(b).forward for b in model.blocks]

    def loss_fn(params, b):
        return F.mse_loss(zf.apply(model, params, b[0]), b[1])

    step = zf.zero3(zf.recompute(zf.train_step(loss_fn, zf.optim.adamw(1e-3))))
    state = step.init(model)
    b = batch("deep_mlp", build("deep_mlp", **kw), 0, 4)
    state, metrics = step(state, b)
    assert all("forward" not in blk.__dict__ for blk in model.blocks)
    assert [type(blk).forward for blk in model.blocks] == own
    ev = zf.zero3(zf.eval_step(loss_fn))(state, b)
    assert torch.isfinite(ev["loss"])


# ------------------------------------------------------------------ randomness and running statistics


class Noisy(nn.Module):
    """Dropout and BatchNorm inside the blocks: what a recomputation must repeat, and what it must
    not count twice."""

    def __init__(self, d: int = 6, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.5), nn.Tanh())
                                    for _ in range(depth))
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _noisy_run(recompute: bool, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = Noisy()

    def loss_fn(params, b):
        return F.mse_loss(zf.apply(model, params, b[0]), b[1])

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    step = zf.zero3(zf.recompute(step) if recompute else step)
    state = step.init(model)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        state, _ = step(state, (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)))
    return {"params": zf.gather_params(state), "buffers": dict(state.buffers)}


def test_dropout_repeats_its_mask_and_running_statistics_update_once():
    """The recomputation draws dropout's mask again from the RNG state checkpoint stashed, so the
    step equals the step without recompute bit for bit, running statistics too: the state's
    BatchNorm statistics are updated by the forward only (plain PyTorch's checkpoint updates its
    module's twice)."""
    plain, again = _noisy_run(False), _noisy_run(True)
    for part in ("params", "buffers"):
        assert plain[part].keys() == again[part].keys()
        for k in plain[part]:
            assert torch.equal(plain[part][k], again[part][k]), (part, k)


# ------------------------------------------------------------------ Hugging Face models


def hf_run(kind: str, hf_checkpointing: bool, steps: int = 3, per_rank: int = 2) -> dict:
    """zero3(offload_cpu(recompute(f))) over a transformers model's loss, each decoder layer a unit
    (``hf_checkpointing``: with transformers' own non-reentrant checkpointing around each layer too)."""
    import hf

    model = hf.build(kind)
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = count_calls(model)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    return hf.train_on_rank(model, loss_fn, steps, per_rank) | {"calls": dict(calls)}


def _hf_reference(kind: str, batch_size: int, hf_checkpointing: bool, steps: int = 3) -> dict:
    import hf

    model = checkpoint_units(hf.build(kind))
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = count_calls(model)
    opt = torch.optim.AdamW(model.parameters(), lr=hf.LR)
    losses = []
    for i in range(steps):
        x = hf.tokens(batch_size, seed=i)
        opt.zero_grad()
        value = model(input_ids=x, labels=x).loss
        value.backward()
        opt.step()
        losses.append(value.item())
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "losses": losses,
            "calls": calls}


@pytest.mark.parametrize("hf_checkpointing", [False, True])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_transformers_models_equal_plain_pytorch(kind, hf_checkpointing):
    """Llama (rotary embeddings passed to each layer as keyword tensors) and GPT-2 (a tied head), at
    W = 2 under zero3 and offload_cpu: plain PyTorch with each decoder layer's forward checkpointed,
    within 1e-5, every layer's modules run again in backward; with transformers' own checkpointing
    on as well, the two nest as they would in plain PyTorch (which runs the layers as often)."""
    expected = _hf_reference(kind, 4, hf_checkpointing)
    layer = ".layers.0." if kind == "llama" else ".h.0."
    assert max(n for k, n in expected["calls"].items() if layer in k) >= 2 * 3  # the oracle recomputes
    for r in workers(2).run(hf_run, kind, hf_checkpointing):
        assert_close_to(r["params"], expected["params"])
        assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert r["calls"] == expected["calls"]


# ------------------------------------------------------------------ compiled blocks


def _compiled_run(how: str, recompute: bool, steps: int = 3) -> dict:
    """Chain's blocks compiled in place (``"blocks"``: zf.compile_units) or the model wrapped
    (``"model"``: torch.compile), aot_eager; each step's saved bytes inside zf.apply and dynamo's
    unique graphs after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Chain()
    model = zf.compile_units(model, backend="aot_eager") if how == "blocks" else torch.compile(model, backend="aot_eager")
    saved, graphs = [], []

    def loss_fn(params, x):
        n, out = _saved_bytes(lambda: zf.apply(model, params, x))
        saved.append(n)
        return out.square().mean()

    step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    step = zf.zero3(zf.recompute(step) if recompute else step)
    state = step.init(model)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        state, _ = step(state, torch.randn(16, 8, generator=g))
        graphs.append(counters["stats"]["unique_graphs"])
    return {"params": zf.gather_params(state), "saved": saved, "graphs": graphs}


@pytest.mark.filterwarnings("ignore::zfunc.GraphBreakWarning")
@pytest.mark.parametrize("how", ["blocks", "model"])
def test_compiled_blocks_trace_the_checkpoint_into_their_graph(how):
    """A compiled block calls the checkpointed forward from its compiled code: the recomputation
    runs inside the compiled backward, which keeps only the block's input and weights (a block's
    activations, GELU's, are not saved), with no recompilation from step to step; bit for bit
    the compiled step without recompute."""
    plain, again = _compiled_run(how, False), _compiled_run(how, True)
    for k in plain["params"]:
        assert torch.equal(plain["params"][k], again["params"][k]), k
    b, d, depth = 16, 8, 3
    boundaries = (depth + 1) * b * d * 4
    weights = sum(p.numel() * 4 for p in Chain().blocks.parameters())
    assert all(n <= boundaries + weights for n in again["saved"]), again["saved"]
    # without: a B x 4d activation of each block at least (the compiler chooses which of GELU's to keep)
    assert all(n > boundaries + weights + depth * b * 4 * d * 4 for n in plain["saved"]), plain["saved"]
    assert again["graphs"] == [again["graphs"][0]] * 3 and again["graphs"][0] == plain["graphs"][0]


@pytest.mark.slow
def test_a_steps_peak_memory_drops_by_the_blocks_activations_under_offload():
    """Each run in a fresh process (RSS, the high-water mark over two steps above the state's):
    zero3(offload_cpu(recompute(f))) on ten blocks 128 -> 2048 -> 128 over 512 tokens peaks lower
    than the step without recompute by more than a third of the 80 MiB of activations inside the
    blocks (45 MiB against 95 MiB when written; what remains: one block recomputed at a time, the
    gradients, allocator slack)."""
    import json
    import os
    import subprocess
    import sys

    harness = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness", "recompute.py")
    runs = {}
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, harness, flag], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr
        runs[flag] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["1"]["peak"] < runs["0"]["peak"] - runs["0"]["activations"] / 3, runs
