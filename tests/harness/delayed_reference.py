"""The delayed update (``offload_cpu(delay=1)``) in plain PyTorch: the reference its tests compare to.

One process, the global batch, ``torch.optim.AdamW`` (the harness's lr and decay). Each step, in
this order (zfunc.transforms.offload.delayed does the same):

1. forward and backward at the model's current parameters (under ``dtype``, a low-precision copy
   of the fp32 master, with the loss times ``loss_scale``), the gradient unscaled into fp32;
2. a step in ``overflow`` is skipped whole: its gradient is never applied and the pending one stays
   pending (the loss scale, which only rounds, is fixed here: its update follows this step's
   gradient, as without delay);
3. the gradient clipped by its own norm (``clip``);
4. while fewer than ``delay_after`` updates have run: ``opt.step()`` with it at once;
5. after: ``opt.step()`` with the pending gradient (if any), and this one becomes pending.

Returns the parameters the next forward would use (``params``: the master's values; under ``dtype``
the master before the pending update), the master with the pending update applied too (``ahead``:
what zfunc's fp32 master and host copy hold), and each step's loss and whether it was skipped.
"""
from __future__ import annotations

import copy

import torch

from cases import LR
from models import batch, build, loss


def delayed_reference(name: str, kw: dict, steps: int, batch_size: int, seed: int = 0, *, delay_after: int = 0,
                      clip: float | None = None, overflow=(), dtype=None, loss_scale: float = 1.0) -> dict:
    master = build(name, seed, **kw)
    low = master if dtype is None else copy.deepcopy(master).to(dtype)
    pairs = [(m, lo) for m, lo in zip(master.parameters(), low.parameters()) if m.requires_grad]
    params = [m for m, _ in pairs]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)

    def apply(grads):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        if low is not master:
            with torch.no_grad():
                for m, lo in pairs:
                    lo.copy_(m)

    pending, updates, losses, skipped = None, 0, [], []
    for i in range(steps):
        x, y = batch(name, master, i, batch_size, seed)
        low.zero_grad(set_to_none=True)
        value = loss(name, low(x.to(dtype) if dtype is not None and x.is_floating_point() else x), y)
        (value * loss_scale).backward()
        losses.append(value.item())
        skipped.append(i in overflow)
        if i in overflow:
            continue
        grads = [None if lo.grad is None else lo.grad.float() / loss_scale for _, lo in pairs]
        if clip is not None:
            for p, g in zip(params, grads):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params, clip)
            grads = [None if p.grad is None else p.grad.clone() for p in params]
        if updates < delay_after:
            apply(grads)
        else:
            if pending is not None:
                apply(pending)
            pending = grads
        updates += 1
    behind = {k: v.detach().clone() for k, v in master.named_parameters()}
    if pending is not None:
        apply(pending)
    ahead = {k: v.detach().clone() for k, v in master.named_parameters()}
    return {"params": behind, "ahead": ahead, "losses": losses, "skipped": skipped}
