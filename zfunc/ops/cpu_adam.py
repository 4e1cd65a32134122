"""The fused CPU Adam/AdamW kernel (csrc/adam/cpu_adam.cpp), and a one-pass norm check.

``zfunc.ops.adam.adam_update_`` is the entry point that routes tensors here;
this module only builds and calls the kernel.
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


def fused_update_(params, grads, exp_avgs, exp_avg_sqs, lowp_params, *args) -> list[int]:
    """One C++ call over the whole list; returns the indices the kernel did not take
    (other devices, non-contiguous tensors, other dtypes), or all when it is not built."""
    kernel = load()
    if kernel is None:
        return list(range(len(params)))
    return list(kernel.adam_update(params, grads, exp_avgs, exp_avg_sqs, lowp_params, *args))


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
