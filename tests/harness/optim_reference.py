"""torch.optim references for the whole-tensor optimizers (zf.optim.muon, adafactor, from_torch, multi):
torch's own classes stepped side by side on a plain model or on plain tensors, the Muon + AdamW recipe's
labels, and Muon in fp64 (torch rounds Newton-Schulz's input to bf16, which ranks' differently
ordered gradient sums can flip; at W > 1 both sides run it unrounded in fp64)."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.optim._muon as torch_muon

import zfunc as zf
from models import batch, build, loss


def hidden(name: str) -> bool:
    """The recipe's Muon parameters in the test GPT: its blocks' 2-D weights (not norms, biases,
    the embedding, the tied head or the positions)."""
    return name.startswith("blocks.") and name.endswith("weight") and ".ln" not in name


def recipe_label(name: str) -> str:
    return "muon" if hidden(name) else "adamw"


MUON = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95}
ADAMW = {"lr": 3e-3, "weight_decay": 0.01}


@contextlib.contextmanager
def unrounded_newton_schulz():
    """torch's Muon with Newton-Schulz in its input's dtype (fp64 for an fp64 model), not bf16."""
    original = torch_muon._zeropower_via_newtonschulz

    def wide(grad, coefficients, steps, eps):
        with mock.patch.object(torch.Tensor, "bfloat16", lambda t: t.clone()):
            return original(grad, coefficients, steps, eps)

    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", wide):
        yield


def torch_recipe(model, muon_kw=None, adamw_kw=None) -> list:
    """torch.optim.Muon on the hidden matrices and AdamW on the rest, side by side."""
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for n, p in named if hidden(n)], **(muon_kw or MUON)),
            torch.optim.AdamW([p for n, p in named if not hidden(n)], **(adamw_kw or ADAMW))]


def zfunc_recipe(ns_dtype=torch.bfloat16, muon_kw=None, adamw_kw=None):
    return zf.optim.multi({"muon": zf.optim.muon(**(muon_kw or MUON), ns_dtype=ns_dtype),
                           "adamw": zf.optim.adamw(**(adamw_kw or ADAMW))}, recipe_label)


def train_torch(name: str, make_opts, steps: int, batch_size: int, dtype=torch.float32, clip: float | None = None,
                kw=None) -> dict:
    """``steps`` steps of torch's optimizers ``make_opts(model)`` on the global batches; the parameters."""
    model = build(name, **(kw or {})).to(dtype)
    opts = make_opts(model)
    ctx = unrounded_newton_schulz() if dtype == torch.float64 else contextlib.nullcontext()
    with ctx:
        for i in range(steps):
            x, y = batch(name, model, i, batch_size)
            for o in opts:
                o.zero_grad()
            loss(name, model(x.to(dtype) if x.is_floating_point() else x), y.to(dtype) if y.is_floating_point() else y
                 ).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for o in opts:
                o.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def torch_on_tensors(make, params: list, grads: list, dtype=torch.float32) -> list:
    """torch optimizer ``make(parameters)`` stepped over ``grads`` (a list per step); the parameters."""
    ps = [torch.nn.Parameter(t.clone().to(dtype)) for t in params]
    opt = make(ps)
    for g in grads:
        for p, x in zip(ps, g):
            p.grad = x.clone().to(dtype)
        opt.step()
    return [p.detach() for p in ps]


def zfunc_on_tensors(opt, params: list, grads: list, dtype=torch.float32) -> list:
    tree = {f"p{k}": t.clone().to(dtype) for k, t in enumerate(params)}
    state = opt.init(tree)
    for g in grads:
        tree, state = opt.update({f"p{k}": x.clone().to(dtype) for k, x in enumerate(g)}, state, tree)
    return [tree[f"p{k}"] for k in range(len(params))]


def problem(shapes, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads
