"""Adam/AdamW over lists of tensors: the one entry point zfunc.optim calls.

Uses the fused C++ kernel for CPU tensors when it is built; otherwise torch's
own fused kernel. Both match ``torch.optim.AdamW`` to fp32 rounding.
"""
from __future__ import annotations

from typing import Sequence

import torch


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
    """
    if not params:
        return
    if grad_scale != 1.0:
        grads = [g * grad_scale for g in grads]
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    steps = [torch.tensor(float(step)) for _ in params]
    fused(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False,
    )
    if lowp_params is not None:
        for low, p in zip(lowp_params, params):
            low.copy_(p)
