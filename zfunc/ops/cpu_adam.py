"""Adam/AdamW over lists of tensors: the one entry point zfunc.optim calls.

CPU tensors go to the fused C++ kernel (csrc/adam/cpu_adam.cpp) when it is
built, CUDA tensors to the multi-tensor CUDA kernel (``zfunc.ops.cuda_adam``);
everything else, and every case where a kernel is not built, to torch's own
fused Adam. All paths match ``torch.optim.AdamW`` to fp32 rounding.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from . import builder

NAME = "cpu_adam"
SOURCES = ["adam/cpu_adam.cpp"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)


def load():
    """The compiled kernel module, or None (``builder.report()`` says why)."""
    return builder.load(NAME, SOURCES)


def available() -> bool:
    return load() is not None


def adam_update_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
    lowp_params: Sequence[torch.Tensor] | None = None,
) -> None:
    """Update ``params``, ``exp_avgs`` and ``exp_avg_sqs`` in place.

    ``step`` is the 1-based step count after this update. Gradients are
    multiplied by ``grad_scale`` first (loss-scale unscale times clip factor).
    ``decoupled`` selects AdamW (decay on the weights) over Adam (decay added
    to the gradient). If ``lowp_params`` is given, each updated parameter is
    also written to its bf16/fp16 twin there. Gradients are not modified.

    Storage the CPU kernel takes in one pass: params fp32 or bf16, grads fp32,
    bf16 or fp16, exp_avg/exp_avg_sq fp32 or bf16 (math always in fp32).
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"adam_update_: {n} params but {len(grads)} grads, {len(exp_avgs)} "
                         f"exp_avgs and {len(exp_avg_sqs)} exp_avg_sqs")
    if lowp_params is not None and len(lowp_params) != n:
        raise ValueError(f"adam_update_: {n} params but {len(lowp_params)} lowp_params")
    if n == 0:
        return
    kw = dict(step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2),
              eps=float(eps), weight_decay=float(weight_decay), decoupled=bool(decoupled),
              grad_scale=float(grad_scale))
    cpu, cuda, rest = [], [], []
    for i, p in enumerate(params):
        (cpu if p.device.type == "cpu" else cuda if p.device.type == "cuda" else rest).append(i)

    if cpu:
        kernel = load()
        if kernel is not None:
            fits = [i for i in cpu if _kernel_fits(params[i], grads[i], exp_avgs[i],
                                                   exp_avg_sqs[i],
                                                   None if lowp_params is None else lowp_params[i])]
            if fits:
                pick = lambda xs: [xs[i] for i in fits]  # noqa: E731
                kernel.adam_update(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                                   [] if lowp_params is None else pick(lowp_params), **kw)
                done = set(fits)
                cpu = [i for i in cpu if i not in done]
        rest += cpu
    if cuda:
        from . import cuda_adam

        pick = lambda xs: [xs[i] for i in cuda]  # noqa: E731
        cuda_adam.adam_update_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                               lowp_params=None if lowp_params is None else pick(lowp_params),
                               **kw)
    if rest:
        pick = lambda xs: [xs[i] for i in rest]  # noqa: E731
        torch_adam_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                    lowp_params=None if lowp_params is None else pick(lowp_params), **kw)


def _kernel_fits(p, g, m, v, low) -> bool:
    ts = (p, g, m, v) if low is None else (p, g, m, v, low)
    return (all(t.device.type == "cpu" and t.is_contiguous() and t.numel() == p.numel()
                for t in ts)
            and p.dtype in _PARAM_DTYPES and g.dtype in _GRAD_DTYPES
            and m.dtype == v.dtype and m.dtype in _STATE_DTYPES
            and (low is None or low.dtype in _LOWP_DTYPES))


@torch.no_grad()
def torch_adam_(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                weight_decay, decoupled, grad_scale=1.0, lowp_params=None) -> None:
    """The same update with ``torch._fused_adam(w)_``: the fallback and the reference.

    Mixed storage (bf16 grads or state, say) is computed on fp32 working copies
    that are written back, so the math is the kernel's.
    """
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    groups: dict[tuple, list] = {}
    for i, p in enumerate(params):
        work = torch.float64 if p.dtype == torch.float64 else torch.float32
        groups.setdefault((p.device, work), []).append(i)
    for (device, work), idx in groups.items():
        ps, gs, ms, vs, back = [], [], [], [], []
        for i in idx:
            p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
            pw, mw, vw = (_work(t, work, device) for t in (p, m, v))
            gw = g.to(device=device, dtype=work)
            if grad_scale != 1.0:
                gw = gw * grad_scale  # a new tensor: the caller's grads stay untouched
            elif gw is g:
                gw = g.contiguous()
            ps.append(pw); gs.append(gw); ms.append(mw); vs.append(vw)
            back += [(dst, src) for dst, src in ((p, pw), (m, mw), (v, vw)) if dst is not src]
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(ps)
        fused(ps, gs, ms, vs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
              weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        for dst, src in back:
            dst.copy_(src)
    if lowp_params is not None:
        for low, p in zip(lowp_params, params):
            low.copy_(p)


def _work(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """``t`` itself if torch's fused kernel can update it in place, else a copy."""
    if t.dtype == dtype and t.device == device and t.is_contiguous():
        return t
    return t.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def nonfinite_and_sq_norm(tensors: Sequence[torch.Tensor]) -> tuple[float, bool]:
    """``(sum of squares, all finite)`` over ``tensors`` in one read of each.

    The sum is accumulated in float64 (no overflow from finite fp32 values), so
    ``finite`` is exact: False iff some element is inf or NaN. Uses the C++
    kernel for contiguous CPU tensors when built, torch otherwise.
    """
    total, finite = 0.0, True
    kernel_ts, other = [], []
    kernel = load() if any(t.device.type == "cpu" for t in tensors) else None
    for t in tensors:
        if (kernel is not None and t.device.type == "cpu" and t.is_contiguous()
                and t.dtype in _GRAD_DTYPES):
            kernel_ts.append(t)
        else:
            other.append(t)
    if kernel_ts:
        s, ok = kernel.nonfinite_and_sq_norm(kernel_ts)
        total += s
        finite &= ok
    if other:
        with torch.no_grad():
            norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in other
                     if t.numel()]
            s = float(torch.stack(norms).square().sum()) if norms else 0.0
        total += s
        finite &= math.isfinite(s)
    return total, finite and math.isfinite(total)
