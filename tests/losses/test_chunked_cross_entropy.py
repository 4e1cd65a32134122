"""zf.chunked_cross_entropy: F.cross_entropy(hidden @ weight.T, labels) in value and gradients
(fp32 within 1e-5; bf16 within a few unit roundoffs of the exact loss, as F.cross_entropy itself),
over drawn shapes, chunk sizes and ignored tokens; no tensor larger than a chunk's logits ever made
and only the inputs and a float a token saved; inside a zero3 step (with zf.recompute and offload)
where the head is a zfunc parameter, tied to the embedding or not, equal to plain PyTorch (fp32) and
within roundoff of plain mixed precision (bf16)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zfunc as zf
from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from fp32_masters import master_step
from models import local
from workers import workers


@st.composite
def problems(draw):
    """hidden (lead..., d), weight (V, d), labels with some tokens ignored, a chunk size."""
    lead = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    d, vocab = draw(st.integers(1, 10)), draw(st.integers(2, 40))
    chunk = draw(st.integers(1, 30))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    hidden = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.1, 1.0, 3.0]))
    labels = torch.randint(0, vocab, lead, generator=g)
    ignored = torch.rand(lead, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.9]))
    labels[ignored] = -100
    labels.view(-1)[0] = 1  # one token counts at least (all ignored: test_all_ignored)
    return hidden, weight, labels, chunk


def _loss_and_grads(fn, hidden, weight, labels, dtype):
    h = hidden.to(dtype).detach().requires_grad_()
    w = weight.to(dtype).detach().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def _plain(h, w, labels, reduction="mean"):
    return F.cross_entropy((h @ w.T).flatten(0, -2), labels.flatten(), reduction=reduction)


def _chunked(chunk, reduction="mean"):
    return lambda h, w, labels: zf.chunked_cross_entropy(h, w, labels, chunk_size=chunk, reduction=reduction)


U32 = 2.0 ** -24  # fp32's unit roundoff


def _exact(hidden, weight, labels, dtype, bias=None, reduction="mean"):
    """In fp64, from the values ``hidden``, ``weight`` (and ``bias``) take in ``dtype``: the exact loss
    and gradients, and the sizes a rounding error in each is relative to: the loss, the tokens'
    largest logits (plus one) it sums; a gradient, the largest sum of the absolute terms its
    products add, the logits' gradient taken before softmax and one-hot cancel (``terms``:
    terms @ |weight|, terms.T @ |hidden|, a column of terms)."""
    h = hidden.to(dtype).double().requires_grad_()
    w = weight.to(dtype).double().requires_grad_()
    b = None if bias is None else bias.to(dtype).double().requires_grad_()
    logits = F.linear(h, w, b)
    logits.retain_grad()
    flat, y = logits.flatten(0, -2), labels.flatten()
    loss = F.cross_entropy(flat, y, reduction=reduction)
    loss.backward()
    valid = y != -100
    per_token = (1 + flat.detach().abs().amax(-1))[valid].sum() / (valid.sum() if reduction == "mean" else 1)
    count = valid.sum() if reduction == "mean" else 1
    g = (torch.softmax(flat.detach(), -1) + F.one_hot(y.clamp(min=0), flat.shape[-1])) * valid[:, None] / count
    sizes = (per_token, (g @ w.detach().abs()).max(), (g.T @ h.detach().abs().flatten(0, -2)).max())
    grads = (loss.detach(), h.grad, w.grad)
    if bias is not None:
        sizes, grads = sizes + (g.sum(0).max(),), grads + (b.grad,)
    return grads, sizes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["mean", "sum"]))
def test_equals_cross_entropy_of_the_full_logits_in_fp32(problem, reduction):
    hidden, weight, labels, chunk = problem
    got = _loss_and_grads(_chunked(chunk, reduction), hidden, weight, labels, torch.float32)
    want = _loss_and_grads(lambda h, w, y: _plain(h, w, y, reduction), hidden, weight, labels, torch.float32)
    _assert_as_exact(got, want, *_exact(hidden, weight, labels, torch.float32, reduction=reduction))


def _assert_as_exact(got, want, exact, sizes):
    """fp32: each of ``got`` (loss, gradients) within 1e-5 of ``want``'s (F.cross_entropy's) relative to
    its largest element, or, where both round more than that (a confident token's loss is the
    small log of a sum near 1; a chunk's logits come from a smaller product than the whole's), no
    further from the exact fp64 value than twice F.cross_entropy's own error or 8 roundoffs of the
    terms it adds (``_exact``'s sizes)."""
    for what, g, w, e, size in zip(("loss", "hidden", "weight", "bias"), got, want, exact, sizes):
        if (g - w).abs().max() <= 1e-5 * w.abs().max():
            continue
        err, plain_err = (g - e).abs().max(), (w - e).abs().max()
        assert err <= max(2 * plain_err, 8 * U32 * size), (what, err.item(), plain_err.item(), size.item())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["mean", "sum"]))
def test_with_a_bias_equals_cross_entropy_of_f_linear_in_fp32(problem, reduction):
    """A head with a bias: F.cross_entropy(F.linear(hidden, weight, bias), labels), the bias's
    gradient too."""
    hidden, weight, labels, chunk = problem
    bias = torch.randn(weight.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(labels.numel()))

    def run(fn):
        h, w, b = (t.float().requires_grad_() for t in (hidden, weight, bias))
        loss = fn(h, w, b)
        loss.backward()
        return loss.detach(), h.grad, w.grad, b.grad

    got = run(lambda h, w, b: zf.chunked_cross_entropy(h, w, labels, bias=b, chunk_size=chunk, reduction=reduction))
    want = run(lambda h, w, b: F.cross_entropy(F.linear(h, w, b).flatten(0, -2), labels.flatten(),
                                               reduction=reduction))
    _assert_as_exact(got, want, *_exact(hidden, weight, labels, torch.float32, bias=bias, reduction=reduction))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_bf16_within_the_bound_of_f_cross_entropy(problem):
    """bf16 inputs, against the exact (fp64) loss of those same bf16 values: the loss and each
    gradient no further off than F.cross_entropy on the full bf16 logits is, or than a few unit
    roundoffs of the terms they add up (the loss: 4 u of 1 + the largest logit, whose rounding it
    inherits; a gradient: 8 u of its products' terms, ``_exact``'s sizes),
    where that one happens to land closer. The fp32 softmax usually makes it closer than
    F.cross_entropy, whose log-softmax and gradient are rounded to bf16."""
    hidden, weight, labels, chunk = problem
    u = UNIT_ROUNDOFF[torch.bfloat16]
    exact, sizes = _exact(hidden, weight, labels, torch.bfloat16)
    ours = _loss_and_grads(_chunked(chunk), hidden, weight, labels, torch.bfloat16)
    plain = _loss_and_grads(_plain, hidden, weight, labels, torch.bfloat16)
    for what, o, p, e, size, c in zip(("loss", "hidden's gradient", "weight's gradient"), ours, plain, exact, sizes,
                                      (4, 8, 8)):
        err, plain_err = (o - e).abs().max(), (p - e).abs().max()
        assert err <= max(plain_err, c * u * size) + 1e-30, (what, err.item(), plain_err.item(), c * u * size.item())


def test_all_ignored_and_the_loss_dtype():
    """No token counts: NaN loss and zero gradients, as F.cross_entropy; the loss is fp32 for
    bf16 inputs (its arithmetic is fp32)."""
    hidden, weight, labels = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64), \
        torch.full((3, 4), -100)
    got = _loss_and_grads(_chunked(5), hidden, weight, labels, torch.float32)
    want = _loss_and_grads(_plain, hidden, weight, labels, torch.float32)
    assert got[0].isnan() and want[0].isnan()
    assert all(torch.equal(g, e) for g, e in zip(got[1:], want[1:]))
    assert zf.chunked_cross_entropy(hidden.bfloat16(), weight.bfloat16(), labels + 101).dtype == torch.float32


def test_refuses_what_f_cross_entropy_would_not_compute():
    h, w, y = torch.randn(4, 5), torch.randn(7, 5), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="must share d"):
        zf.chunked_cross_entropy(h, torch.randn(7, 4), y)
    with pytest.raises(ValueError, match="labels must be integers shaped like hidden"):
        zf.chunked_cross_entropy(h, w, torch.zeros(4, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be integers"):
        zf.chunked_cross_entropy(h, w, torch.zeros(4))
    with pytest.raises(ValueError, match="bias must be weight's"):
        zf.chunked_cross_entropy(h, w, y, bias=torch.zeros(6))
    with pytest.raises(ValueError, match="bias must be weight's"):
        zf.chunked_cross_entropy(h, w, y, bias=torch.zeros(7, dtype=torch.float64))
    with pytest.raises(ValueError, match="share a dtype"):
        zf.chunked_cross_entropy(h, w.double(), y)
    with pytest.raises(ValueError, match="chunk_size"):
        zf.chunked_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="reduction"):
        zf.chunked_cross_entropy(h, w, y, reduction="none")


# ------------------------------------------------------------------ memory


class _Largest(TorchDispatchMode):
    """The bytes of the largest tensor any op makes while it is on."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _measured(fn, n, d, vocab):
    torch.manual_seed(0)
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(vocab, d, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    saved = {}

    def pack(t):
        saved[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with _Largest() as largest:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(h, w, y)
        loss.backward()
    return largest.bytes, sum(saved.values())


def test_no_tensor_beyond_a_chunk_of_logits_and_a_float_a_token_saved():
    """96 tokens, vocabulary 64, chunks of 8: forward and backward make no tensor larger than the
    largest of a chunk's fp32 logits, hidden and the weight's gradient (the full logits are 12x a
    chunk's, and F.cross_entropy's path does make them); autograd keeps hidden, the weight, the
    labels (int64 and their mask) and one fp32 log-sum-exp a token."""
    n, d, vocab, chunk = 96, 8, 64, 8
    largest, saved = _measured(lambda h, w, y: zf.chunked_cross_entropy(h, w, y, chunk_size=chunk), n, d, vocab)
    assert largest <= max(chunk * vocab, n * d, vocab * d) * 4 < n * vocab * 4
    assert saved == n * d * 4 + vocab * d * 4 + n * 8 + n * 1 + n * 4 + 4
    plain_largest, plain_saved = _measured(lambda h, w, y: F.cross_entropy(h @ w.T, y), n, d, vocab)
    assert plain_largest >= n * vocab * 4 and plain_saved >= n * vocab * 4


# ------------------------------------------------------------------ in a zfunc step


class TinyLM(nn.Module):
    """Embedding, residual blocks, a final norm; the LM head applied by the loss: ``head`` tied to the
    embedding (``"tied"``), its own weight in the root unit (``"root"``; ``"bias"``: with a bias), or
    a unit of its own that only the loss reads (``"unit"``: ``heads.0``, gathered there and again in
    backward)."""

    def __init__(self, vocab: int = 23, d: int = 8, layers: int = 2, head: str = "tied"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh()) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        linear = nn.Linear(d, vocab, bias=head == "bias")
        if head == "tied":
            linear.weight = self.tok.weight
        if head == "unit":
            self.heads = nn.ModuleList([linear])
        else:
            self.head = linear
        self.head_name = "heads.0.weight" if head == "unit" else "head.weight"

    def head_weight(self):
        return self.get_parameter(self.head_name)

    def head_bias(self):
        return self.head.bias if hasattr(self, "head") else None

    def logits(self, hidden):
        return F.linear(hidden, self.head_weight(), self.head_bias())

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.ln(x)


def _tokens(step: int, world: int):
    """The global batch: (tokens, labels) with ignored positions, as many on each rank's half."""
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 23, (2 * world, 7), generator=g)
    labels = torch.randint(0, 23, (2 * world, 7), generator=g)
    labels[:, :2] = -100  # a prompt the loss ignores
    return idx, labels


def chunked_lm_run(head: str, composition: str, read: str, steps: int = 3) -> dict:
    """``steps`` steps on this rank's half, the loss zf.chunked_cross_entropy over the head's weight
    (``read``: from the ParamView by name, or through the model's stand-in)."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    torch.manual_seed(0)
    model = TinyLM(head=head)

    def loss_fn(params, b):
        idx, labels = b
        if read == "params":
            weight, bias = params[model.head_name], params["head.bias"] if head == "bias" else None
        else:
            weight, bias = model.head_weight(), model.head_bias()
        return zf.chunked_cross_entropy(zf.apply(model, params, idx), weight, labels, bias=bias, chunk_size=5)

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.01))
    if composition == "recompute-offload":
        step = zf.zero3(zf.offload_cpu(zf.recompute(step)))
    else:
        step = zf.zero3(step)
    state = step.init(model)
    losses = []
    for i in range(steps):
        state, metrics = step(state, local(_tokens(i, world), rank, world))
        losses.append(metrics["loss"].item())
    return {"params": zf.gather_params(state), "losses": losses}


def _reference(head: str, world: int, steps: int = 3) -> dict:
    """Plain PyTorch, the full logits: each rank's half's mean loss, averaged over the halves (what
    the ranks' gradients average to), torch.optim.AdamW."""
    torch.manual_seed(0)
    model = TinyLM(head=head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for i in range(steps):
        b = _tokens(i, world)
        halves = [local(b, r, world) for r in range(world)]
        opt.zero_grad()
        loss = sum(F.cross_entropy(model.logits(model(idx)).flatten(0, 1), y.flatten())
                   for idx, y in halves) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "losses": losses}


@pytest.mark.parametrize("head", ["tied", "root", "unit", "bias"])
@pytest.mark.parametrize("composition,read", [("zero3", "params"), ("zero3", "stand-in"),
                                              ("recompute-offload", "params")])
def test_in_a_zero3_step_equals_plain_pytorch(head, composition, read):
    """W = 2, fp32, relative 1e-5: the head's weight gathered by zfunc (tied: the embedding's, in
    the root unit; or a unit only the loss reads), saved by the loss for backward as a handle and
    re-gathered there; read by name from the ParamView or through the model's stand-in."""
    expected = _reference(head, 2)
    for r in workers(2).run(chunked_lm_run, head, composition, read):
        assert_close_to(r["params"], expected["params"])
        assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)


def _bf16_reference(head: str, steps: int) -> dict:
    """Plain PyTorch mixed precision on the full logits: a bf16 copy runs forward and backward, fp32
    AdamW updates the master, cast back into the copy."""
    torch.manual_seed(0)
    master = TinyLM(head=head)
    init = {k: v.detach().clone() for k, v in master.named_parameters()}
    low = TinyLM(head=head).to(torch.bfloat16)
    low.load_state_dict(master.state_dict())
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.01)
    for i in range(steps):
        idx, y = _tokens(i, 1)
        low.zero_grad(set_to_none=True)
        F.cross_entropy((low(idx) @ low.head_weight().T).float().flatten(0, 1), y.flatten()).backward()
        master_step(master, low, opt)
    return {"params": {k: v.detach().clone() for k, v in master.named_parameters()}, "init": init}


@pytest.mark.parametrize("head", ["tied", "unit"])
def test_in_a_bf16_zero3_step_within_roundoff_of_plain_mixed_precision(head):
    """zero3(mixed_precision(bf16)), one process: the head's bf16 weight and hidden states into the
    chunked loss; the fp32 master weights within assert_within_roundoff's Adam bounds of plain
    PyTorch's mixed precision on the full logits."""
    steps = 3
    torch.manual_seed(0)
    model = TinyLM(head=head)

    def loss_fn(params, b):
        idx, labels = b
        return zf.chunked_cross_entropy(zf.apply(model, params, idx), params[model.head_name], labels, chunk_size=4)

    step = zf.zero3(zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.01)),
                                       torch.bfloat16))
    state = step.init(model)
    for i in range(steps):
        state, metrics = step(state, _tokens(i, 1))
        assert metrics["loss"].dtype == torch.float32 and torch.isfinite(metrics["loss"])
    ref = _bf16_reference(head, steps)
    assert_within_roundoff(zf.gather_params(state), ref["params"], ref["init"], UNIT_ROUNDOFF[torch.bfloat16],
                           sgd=False)


def hf_llama_run(steps: int = 3, per_rank: int = 2) -> dict:
    """transformers' Llama under zero3(offload_cpu(recompute(f))): the loss from the final hidden
    states (``output_hidden_states``; ``logits_to_keep=1``, so the model makes one position's
    logits only) through zf.chunked_cross_entropy over ``lm_head.weight``, labels shifted as
    transformers shifts them."""
    import hf

    model = hf.build("llama")

    def loss_fn(params, x):
        out = zf.apply(model, params, input_ids=x, output_hidden_states=True, logits_to_keep=1)
        return zf.chunked_cross_entropy(out.hidden_states[-1][:, :-1], params["lm_head.weight"], x[:, 1:],
                                        chunk_size=5)

    return hf.train_on_rank(model, loss_fn, steps, per_rank)


def test_a_transformers_llama_trains_as_with_its_own_loss():
    """W = 2: the recipe of docs/architecture.md equals plain transformers' ``model(input_ids=x,
    labels=x).loss`` on the global batch (relative 1e-5)."""
    import hf

    ref = hf.build("llama")
    opt = torch.optim.AdamW(ref.parameters(), lr=hf.LR)
    losses = []
    for i in range(3):
        x = hf.tokens(4, seed=i)
        opt.zero_grad()
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    expected = {k: v.detach().clone() for k, v in ref.named_parameters()}
    for r in workers(2).run(hf_llama_run):
        assert_close_to(r["params"], expected)
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
