"""Muon, the math of ``torch.optim.Muon``: momentum, then each 2-D matrix's update orthogonalized by
Newton-Schulz, a whole-tensor optimizer (zfunc.optim.whole) whose owners are balanced by
Newton-Schulz's FLOPs for each matrix's shape.

Per matrix ``W`` (m x n) with gradient ``G``, as torch does it::

    B <- lerp(B, G, 1 - momentum)                      (the momentum buffer, laid out like the params)
    U <- lerp(G, B, momentum) if nesterov else B
    O <- NS(U)                                         (ns_steps quintic iterations, in ns_dtype)
    W <- W * (1 - lr * weight_decay) - adjusted_lr * O

``adjusted_lr``: ``lr * sqrt(max(1, m / n))`` ("original", Keller Jordan's) or
``0.2 * lr * sqrt(max(m, n))`` ("match_rms_adamw", Moonshot's). torch rounds Newton-Schulz's input
to bf16 (``ns_dtype=torch.bfloat16``, the default here too); ``ns_dtype=torch.float32`` or
``torch.float64`` runs it wider.

Muon is for hidden 2-D matrices: give embeddings, the head, norms and biases to AdamW with
``zf.optim.multi`` (zfunc.optim.multi).
"""
from __future__ import annotations

import math

import torch

from .base import Optimizer
from .lr import ScalarOrSchedule, as_schedule
from .whole import Item, Rule, optimizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
ADJUST = (None, "original", "match_rms_adamw")


def newton_schulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = EPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``g`` orthogonalized (about ``U V^T`` of its SVD) by ``steps`` quintic Newton-Schulz
    iterations in ``dtype``: torch's ``_zeropower_via_newtonschulz`` with the dtype a choice."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
    """Newton-Schulz's FLOPs for a matrix of ``shape`` (per iteration: the Gram matrix, its square
    and the product with the matrix, with m <= n after the transpose): what owners balance."""
    m, n = sorted(shape[:2]) if len(shape) >= 2 else (1, shape[0] if shape else 1)
    return float(steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n))


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr


def muon(lr: ScalarOrSchedule = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
         ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = 5,
         adjust_lr_fn: str | None = None, groups=(), ns_dtype: torch.dtype = torch.bfloat16) -> Optimizer:
    """Muon over 2-D parameters, ``torch.optim.Muon``'s arguments and defaults (module docstring);
    ``groups``: per-parameter values (``zf.optim.group``); ``ns_dtype``: Newton-Schulz's dtype."""

    def check(h):
        if not callable(h["lr"]):
            as_schedule("muon", h["lr"])
        for key in ("momentum", "weight_decay"):
            if not callable(h[key]) and not h[key] >= 0.0:
                raise ValueError(f"muon: {key} must be >= 0, got {h[key]}")
        if h["adjust_lr_fn"] not in ADJUST:
            raise ValueError(f"muon: adjust_lr_fn must be one of {ADJUST}, got {h['adjust_lr_fn']!r}")
        if not 0 < h["ns_steps"] < 100:
            raise ValueError(f"muon: ns_steps must be in [1, 100), got {h['ns_steps']}")

    def check_param(name, shape):
        if len(shape) != 2:
            raise ValueError(
                f"muon: parameter {name!r} has shape {tuple(shape)}; Muon updates 2-D matrices only (as "
                "torch.optim.Muon). Give the others to AdamW: zf.optim.multi(lambda name: 'muon' if <hidden "
                "matrix> else 'adamw', muon=zf.optim.muon(...), adamw=zf.optim.adamw(...))")

    def update(items: list[Item], h: dict) -> None:
        for it in items:
            buf = it.state["momentum_buffer"]
            buf.lerp_(it.grad, 1 - h["momentum"])
            u = it.grad.lerp(buf, h["momentum"]) if h["nesterov"] else buf
            o = newton_schulz(u, h["ns_coefficients"], h["ns_steps"], h["eps"], ns_dtype)
            it.param.mul_(1 - h["lr"] * h["weight_decay"])
            it.param.add_(o, alpha=-adjusted_lr(h["lr"], h["adjust_lr_fn"], it.param.shape))

    rule = Rule("muon", update, shaped=("momentum_buffer",), cost=lambda s: ns_flops(s, ns_steps),
                check_param=check_param)
    hyper = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
             "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
    return optimizer(rule, hyper, check, groups)
