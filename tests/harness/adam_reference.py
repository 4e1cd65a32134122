"""Adam/AdamW in float64: the oracle for every fused-kernel test, with its tolerance.

Why a float64 oracle and not torch.optim: torch's fp32 for-loop Adam is itself
an fp32 computation, a few ulps off the exact result, and which of two fp32
implementations is "right" at an element is a coin toss (2 of 2.5M elements
differed by 3e-5 on a fresh machine). The exact result is float64.

Tolerance, derived from fp32 rounding (u = 2^-24, half an ulp, relative):
one fp32 step computes m, v, the bias corrections, sqrt, a division and the
parameter update, each rounding once, and with FMA contraction the kernel may
round fewer times than the formula; we allow C = 16 roundings per step. Each
rounding is relative to the size of what it rounds: the parameter (|p|),
its decay (lr*wd*|p|) and the update (lr*|m_hat|/(sqrt(v_hat)+eps)). The
error in m is relative to the size of the terms averaged into it, not to m:
with Adam's L2 decay the gradient is g + wd*p, which can cancel, so m's error
is C*u times an average of |g| + wd*|p| (``mag``, decayed like m), and it
moves the update by lr*mag_hat/(sqrt(v_hat)+eps) times that. Errors of
earlier steps carry over unamplified (the update of p is additive), so the
bound after T steps is the per-element sum over steps:
tol = C * u * sum_t (|p_t| + lr*wd*|p_t| + |update_t| + lr*mag_hat_t/(sqrt(v_hat_t)+eps)),
and for m the sum of |b1*m| + (1-b1)*(|g| + wd*|p|), for v the sum of its terms
(with |g| + wd*|p| for the gradient: under L2 decay the sum g + wd*p may cancel,
and the parameter's error so far, wd times its bound, enters that sum too).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

C, U = 16, 2.0 ** -24


class Reference(NamedTuple):
    params: list[torch.Tensor]  # float64
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    tol_params: list[torch.Tensor]  # per element
    tol_exp_avgs: list[torch.Tensor]
    tol_exp_avg_sqs: list[torch.Tensor]


def adam_f64(params, grads, *, lr, betas, eps, wd, decoupled) -> Reference:
    """``len(grads)`` steps of Adam (``decoupled=False``) or AdamW from ``params``."""
    b1, b2 = betas
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    tp, tm, tv, mag = ([torch.zeros_like(p) for p in ps] for _ in range(4))
    for t, gs in enumerate(grads, start=1):
        for i, g in enumerate(gs):
            g = g.double()
            p = ps[i]
            decay = lr * wd * p.abs() if decoupled else torch.zeros_like(p)
            terms = g.abs() + (0.0 if decoupled else wd) * p.abs()  # what g + wd*p rounds relative to
            mag[i] = b1 * mag[i] + (1 - b1) * terms
            if decoupled:
                p.mul_(1 - lr * wd)
            else:
                g = g + wd * p
            # under L2 decay the parameter's own error so far enters g + wd*p
            carried = 0.0 if decoupled else wd * tp[i]
            tm[i] += b1 * ms[i].abs() + (1 - b1) * (terms + carried)
            tv[i] += b2 * vs[i] + (1 - b2) * terms * (terms + 2 * carried)
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            denom = (vs[i] / (1 - b2 ** t)).sqrt() + eps
            update = lr * (ms[i] / (1 - b1 ** t)) / denom
            tp[i] += p.abs() + decay + update.abs() + lr * (mag[i] / (1 - b1 ** t)) / denom
            p.sub_(update)
    scale = lambda ts: [C * U * t for t in ts]  # noqa: E731
    return Reference(ps, ms, vs, scale(tp), scale(tm), scale(tv))


def assert_within(got, want, tol, what: str = "params") -> None:
    """Every element of ``got`` within ``tol`` of the float64 ``want``."""
    for i, (g, w, t) in enumerate(zip(got, want, tol)):
        err = (g.detach().double().cpu() - w).abs()
        bad = err > t
        if bad.any():
            j = int((err - t).argmax())
            raise AssertionError(
                f"{what}[{i}]: {int(bad.sum())} of {err.numel()} elements off the float64 Adam by more "
                f"than the fp32 rounding bound; worst at {j}: {g.reshape(-1)[j].item()} vs "
                f"{w.reshape(-1)[j].item()} (bound {t.reshape(-1)[j].item():.3g})"
            )
