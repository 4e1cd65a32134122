"""Adam/AdamW over lists of tensors: the one entry point zfunc.optim calls.

CPU tensors go to the fused C++ kernel (``zfunc.ops.cpu_adam``) when it is
built, CUDA tensors to the multi-tensor CUDA kernel (``zfunc.ops.cuda_adam``);
everything else, and every case where a kernel is not built, to torch's own
fused Adam (``zfunc.ops.torch_adam``). All paths match ``torch.optim.AdamW``
to fp32 rounding.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import cpu_adam, cuda_adam
from .adam_checks import check_lists
from .torch_adam import torch_adam_


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
    check_lists(params, grads, exp_avgs, exp_avg_sqs, lowp_params, step)
    if not params:
        return
    args = (int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            bool(decoupled), float(grad_scale))
    rest = cpu_adam.fused_update_(params, grads, exp_avgs, exp_avg_sqs,
                                  () if lowp_params is None else lowp_params, *args)
    if not rest:
        return
    kw = dict(zip(("step", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
                   "grad_scale"), args))
    cuda = [i for i in rest if params[i].device.type == "cuda"]
    other = [i for i in rest if params[i].device.type != "cuda"]
    for idx, update in ((cuda, cuda_adam.adam_update_), (other, torch_adam_)):
        if idx:
            pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
            update(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                   lowp_params=None if lowp_params is None else pick(lowp_params), **kw)
