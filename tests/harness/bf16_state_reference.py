"""Adam with its moments kept in bf16, defined in plain PyTorch: the reference of
``zf.optim.adamw(..., state_dtype=torch.bfloat16)``.

The definition: ``torch.optim.AdamW`` whose ``exp_avg`` and ``exp_avg_sq`` are rounded to bf16
(round to nearest even, torch's cast) after every step. So each step reads the stored bf16
moments (exactly, as fp32), does all its math in fp32, moves the parameter by the unrounded new
moments, and stores them rounded: what zfunc's CPU kernel and its torch fallback do. The moments
are held here in fp32 tensors whose values are bf16 numbers, so torch's own step does the math.

Tolerance against zfunc: the kernel's fp32 arithmetic differs from torch's for-loop AdamW by an
ulp or so, and where that lands a moment on the other side of a bf16 rounding boundary the two
store neighbouring bf16 numbers (2 of 100,003 elements after 5 steps). ``assert_moments_close``
allows that: every element equal or one bf16 step apart, and few of them apart. The parameter
moves by at most lr * 2^-8 relative to its update for each such flip, so parameters compare at
1e-5 (lr 1e-3, a few steps).
"""
from __future__ import annotations

import copy

import torch

from cases import LR
from models import batch, build, loss

MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamWBf16State(torch.optim.AdamW):
    """``torch.optim.AdamW`` with its moments rounded to bf16 after each step (the module docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for state in self.state.values():
            for key in MOMENTS:
                state[key].copy_(state[key].to(torch.bfloat16))
        return out


def reference(name: str, kw: dict, steps: int = 3, batch_size: int = 4, seed: int = 0, dtype=None,
              clip: float | None = None) -> dict:
    """Plain PyTorch on the global batch, one process: the fp32 model (``dtype=None``), or mixed
    precision as ``cases.reference_mixed`` (a ``dtype`` copy runs forward and backward, the fp32
    master is updated and cast back), updated by ``AdamWBf16State``. Returns the parameters (the
    master's), the losses and each parameter's moments as bf16, keyed by name."""
    master = build(name, seed, **kw)
    low = master if dtype is None else copy.deepcopy(master).to(dtype)
    named = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    opt = AdamWBf16State([p for _, p in named], lr=LR, weight_decay=0.01)
    losses = []
    for i in range(steps):
        x, y = batch(name, master, i, batch_size, seed)
        low.zero_grad(set_to_none=True)
        value = loss(name, low(x.to(dtype) if dtype is not None and x.is_floating_point() else x), y)
        value.backward()
        if low is not master:
            for mp, lp in zip(master.parameters(), low.parameters()):
                mp.grad = None if lp.grad is None else lp.grad.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
        opt.step()
        if low is not master:
            with torch.no_grad():
                for mp, lp in zip(master.parameters(), low.parameters()):
                    lp.copy_(mp)
        losses.append(value.item())
    moments = {key: {n: opt.state[p][key].to(torch.bfloat16) for n, p in named if p in opt.state}
               for key in MOMENTS}
    return {"params": {n: p.detach().clone() for n, p in master.named_parameters()}, "losses": losses,
            "moments": moments}


def assert_moments_close(got: dict, want: dict, what: str, most_apart: float = 0.01) -> None:
    """``got`` and ``want`` (name -> bf16 tensor) hold the same bf16 numbers, but for elements one
    bf16 step apart (the module docstring), at most ``most_apart`` of them."""
    assert list(got) == list(want), f"{what}: names {list(got)} vs {list(want)}"
    apart = total = 0
    for n in want:
        g, w = got[n], want[n]
        assert g.dtype == torch.bfloat16 and w.dtype == torch.bfloat16, f"{what}[{n}]: {g.dtype}, {w.dtype}"
        steps = (g.view(torch.int16).int() - w.view(torch.int16).int()).abs()
        same_sign = torch.signbit(g) == torch.signbit(w)
        near = (steps <= 1) & same_sign | (g.float() == w.float())
        assert bool(near.all()), (f"{what}[{n}]: {int((~near).sum())} elements more than one bf16 step from the "
                                  f"reference, e.g. {g[~near][:3].tolist()} vs {w[~near][:3].tolist()}")
        apart += int((g.float() != w.float()).sum())
        total += g.numel()
    assert apart <= most_apart * total, f"{what}: {apart} of {total} elements one bf16 step from the reference"
