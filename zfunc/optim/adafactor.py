"""Adafactor, the math of ``torch.optim.Adafactor`` (its single-tensor path), a whole-tensor optimizer
(zfunc.optim.whole): a matrix's second moment is kept as its row and column means (``row_var``,
``col_var``, over the last two dimensions), a vector's whole (``variance``); the update's RMS is
clipped to ``d`` and scaled by the parameter's RMS. Each needs whole parameters (the means, the
parameter's and the update's norms), so each has one owner, balanced by its elements; its state
(about ``rows + columns`` per matrix) lives on the owner only.
"""
from __future__ import annotations

import torch

from .base import Optimizer
from .lr import ScalarOrSchedule, as_schedule
from .whole import Item, Rule, optimizer


def _slots(name, shape, dtype, device) -> dict:
    if len(shape) > 1:
        row, col = list(shape), list(shape)
        row[-1], col[-2] = 1, 1
        return {"row_var": torch.zeros(row, dtype=dtype, device=device),
                "col_var": torch.zeros(col, dtype=dtype, device=device)}
    return {"variance": torch.zeros(shape, dtype=dtype, device=device)}


def adafactor(lr: ScalarOrSchedule = 1e-2, beta2_decay: float = -0.8, eps: tuple[float | None, float] = (None, 1e-3),
              d: float = 1.0, weight_decay: float = 0.0, maximize: bool = False, groups=()) -> Optimizer:
    """Adafactor with ``torch.optim.Adafactor``'s arguments and defaults; ``groups``: per-parameter values."""

    def check(h):
        if not callable(h["lr"]):
            as_schedule("adafactor", h["lr"])
        if not callable(h["beta2_decay"]) and not h["beta2_decay"] <= 0.0:
            raise ValueError(f"adafactor: beta2_decay must be <= 0, got {h['beta2_decay']}")
        if not callable(h["d"]) and not h["d"] >= 1.0:
            raise ValueError(f"adafactor: d must be >= 1, got {h['d']}")
        if not callable(h["weight_decay"]) and not h["weight_decay"] >= 0.0:
            raise ValueError(f"adafactor: weight_decay must be >= 0, got {h['weight_decay']}")

    def update(items: list[Item], h: dict) -> None:
        lr, (eps1, eps2) = h["lr"], h["eps"]
        for it in items:
            param, grad, s = it.param, (-it.grad if h["maximize"] else it.grad), it.state
            e1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
            step = float(it.step + 1)
            one_minus_beta2 = step ** h["beta2_decay"]
            rho = min(lr, 1 / (step ** 0.5))
            alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho
            if h["weight_decay"] != 0:
                param.mul_(1 - lr * h["weight_decay"])
            if grad.dim() > 1:
                row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
                s["row_var"].lerp_(row_mean, one_minus_beta2)
                col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
                s["col_var"].lerp_(col_mean, one_minus_beta2)
                var = s["row_var"] @ s["col_var"]
                var.div_(s["row_var"].mean(dim=-2, keepdim=True).clamp_(min=e1))
            else:
                s["variance"].lerp_(grad * grad, one_minus_beta2)
                var = s["variance"].clone()
            upd = var.clamp_(min=e1 * e1).rsqrt_()
            upd.mul_(grad)
            denom = max(1.0, upd.norm(2).item() / ((upd.numel() ** 0.5) * h["d"]))
            param.add_(upd, alpha=-alpha / denom)

    rule = Rule("adafactor", update, init_slots=_slots)
    hyper = {"lr": lr, "beta2_decay": beta2_decay, "eps": tuple(eps), "d": d, "weight_decay": weight_decay,
             "maximize": maximize}
    return optimizer(rule, hyper, check, groups)
