"""The one check of Adam's tensor lists that every entry point runs before any kernel."""
from __future__ import annotations

import torch

LOWP_DTYPES = (torch.bfloat16, torch.float16)


def check_lists(params, grads, exp_avgs, exp_avg_sqs, lowp_params, step: int) -> None:
    """Raise ``ValueError`` naming the first bad entry, before any kernel sees the lists: a
    native op's own checks are its last line, not the one users meet (they throw across a
    C++ boundary, and a build that mishandles that crashes the process)."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"adam_update_: {n} params but {len(grads)} grads, {len(exp_avgs)} "
                         f"exp_avgs and {len(exp_avg_sqs)} exp_avg_sqs")
    if lowp_params is not None and len(lowp_params) != n:
        raise ValueError(f"adam_update_: {n} params but {len(lowp_params)} lowp_params")
    if int(step) < 1:
        raise ValueError(f"adam_update_: step must be >= 1 (1-based, after this update), got {step}")
    for i, p in enumerate(params):
        for what, ts in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                         ("lowp_params", lowp_params)):
            if ts is not None and ts[i].numel() != p.numel():
                raise ValueError(f"adam_update_: {what}[{i}] has {ts[i].numel()} elements, "
                                 f"the param {p.numel()}")
        if not (exp_avgs[i].is_floating_point() and exp_avg_sqs[i].is_floating_point()):
            raise ValueError(f"adam_update_: exp_avgs[{i}] and exp_avg_sqs[{i}] must be floating point, "
                             f"got {exp_avgs[i].dtype} and {exp_avg_sqs[i].dtype}")
        if lowp_params is not None and lowp_params[i].dtype not in LOWP_DTYPES:
            raise ValueError(f"adam_update_: lowp_params[{i}] is {lowp_params[i].dtype}; a low-precision "
                             "copy must be bf16 or fp16")
