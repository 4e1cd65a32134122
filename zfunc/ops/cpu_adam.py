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
    args = (int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            bool(decoupled), float(grad_scale))
    kernel = load()
    if kernel is not None:
        # One C++ call for the whole list; it hands back what it cannot take
        # (other devices, non-contiguous tensors, other dtypes).
        rest = kernel.adam_update(params, grads, exp_avgs, exp_avg_sqs,
                                  () if lowp_params is None else lowp_params, *args)
        if not rest:
            return
    else:
        rest = range(n)
    kw = dict(zip(("step", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
                   "grad_scale"), args))
    cuda = [i for i in rest if params[i].device.type == "cuda"]
    other = [i for i in rest if params[i].device.type != "cuda"]
    for idx, update in ((cuda, _cuda_update), (other, torch_adam_)):
        if idx:
            pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
            update(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                   lowp_params=None if lowp_params is None else pick(lowp_params), **kw)


def _cuda_update(*args, **kw) -> None:
    from . import cuda_adam

    cuda_adam.adam_update_(*args, **kw)


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
    kernel = load()
    other = list(tensors)
    if kernel is not None and other:
        total, finite, rest = kernel.nonfinite_and_sq_norm(other)
        other = [other[i] for i in rest]
    if other:
        with torch.no_grad():
            norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in other
                     if t.numel()]
            s = float(torch.stack(norms).square().sum()) if norms else 0.0
        total += s
        finite &= math.isfinite(s)
    return total, finite and math.isfinite(total)
