"""Adam/AdamW on torch's own fused kernels: the fallback of every zfunc Adam, and its reference."""
from __future__ import annotations

import torch


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
