"""Multi-tensor fused Adam/AdamW for CUDA tensors (csrc/adam/cuda_adam.cu).

One kernel launch updates every tensor of a call (per dtype combination):
params and grads fp32, bf16 or fp16, state fp32, optional bf16/fp16 twin of
the params written in the same pass. Built only where torch sees a GPU and
nvcc exists; otherwise, and for tensors the kernel does not take, the update
goes to torch's ``_fused_adam(w)_`` with the same math.

``emulated()`` is the testing entry point: the same kernel source built with
the C++ compiler, its grid run block by block, thread by thread, over CPU
tensors. Slow, and never used for training, but it is how machines without a
GPU (CI among them) test the kernel itself: its only coverage there.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import builder
from .adam_checks import LOWP_DTYPES, check_lists
from .torch_adam import torch_adam_

NAME = "cuda_adam"
SOURCES = ["adam/cuda_adam.cpp", "adam/cuda_adam.cu"]
EMULATED_SOURCES = ["adam/cuda_adam_emulated.cpp"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load():
    """The compiled kernel module, or None (``builder.report()`` says why)."""
    return builder.load(NAME, SOURCES, cuda=True)


def emulated():
    """For tests: the kernel's source built for the CPU (its ``adam_update`` takes CPU
    tensors, same arguments as the CUDA op's), or None (``builder.report()`` says why)."""
    return builder.load(NAME + "_emulated", EMULATED_SOURCES, extra_cflags=["-fvisibility=hidden"])


def available() -> bool:
    return load() is not None


def adam_update_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                 step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, decoupled: bool, grad_scale: float = 1.0,
                 lowp_params: Sequence[torch.Tensor] | None = None) -> None:
    """``zfunc.ops.adam.adam_update_`` for CUDA tensors (same contract)."""
    check_lists(params, grads, exp_avgs, exp_avg_sqs, lowp_params, step)
    kw = dict(step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2),
              eps=float(eps), weight_decay=float(weight_decay), decoupled=bool(decoupled),
              grad_scale=float(grad_scale))
    if not params:
        return
    kernel = load()
    rest = list(range(len(params)))
    if kernel is not None:
        by_device: dict[torch.device, list[int]] = {}
        for i in rest:
            low = None if lowp_params is None else lowp_params[i]
            if _fits(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], low):
                by_device.setdefault(params[i].device, []).append(i)
        for idx in by_device.values():
            pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
            kernel.adam_update(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                               [] if lowp_params is None else pick(lowp_params), **kw)
        done = {i for idx in by_device.values() for i in idx}
        rest = [i for i in rest if i not in done]
    if rest:
        pick = lambda xs: [xs[i] for i in rest]  # noqa: E731
        torch_adam_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                    lowp_params=None if lowp_params is None else pick(lowp_params), **kw)


def _fits(p, g, m, v, low) -> bool:
    ts = (p, g, m, v) if low is None else (p, g, m, v, low)
    return (all(t.is_cuda and t.device == p.device and t.is_contiguous()
                and t.numel() == p.numel() for t in ts)
            and p.dtype in _DTYPES and g.dtype in _DTYPES
            and m.dtype == torch.float32 and v.dtype == torch.float32
            and (low is None or low.dtype in LOWP_DTYPES))
