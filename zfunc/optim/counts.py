"""The optimizers' update counts, and which parts of the parameters an update touches.

An optimizer's state holds ``count``, a 0-d int64 CPU tensor (updates applied so far, the
schedule's step; it stays on CPU wherever the rest of the state goes), and ``steps``, the updates
each parameter got (its bias correction; int64 on the CPU: for a zfunc ``Params``, one count per
parameter of each unit, the same on every rank; for other pytrees, one 0-d count per leaf).

A ``None`` gradient leaf means "no gradient": that leaf is not updated, its moments and its
``steps`` stay as they were, exactly as ``torch.optim`` skips a parameter whose ``.grad`` is None.
Within a unit of a ``Params``, ``GradInfo.live`` says the same per parameter. So an update works on
parts of leaves, grouped by the updates each part has had (:func:`live_by_step`).
"""
from __future__ import annotations

import torch

from .base import GradInfo, PyTree
from ..pytree import tree_flatten, tree_map
from ..tree import Params

Part = tuple[int, int] | None  # elements [start, stop) of a leaf; None: all of it


def zero_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def zero_steps(params) -> PyTree:
    """No updates yet: for a zfunc ``Params``, one count per parameter of each unit (its parameters
    may miss updates apart, and torch counts per parameter), the whole unit's on every rank, even
    where a rank's slice holds none of a parameter, so the counts stay the same everywhere; for
    any other pytree, one 0-d count per leaf."""
    if isinstance(params, Params):
        spec = params.spec
        return Params(spec, [torch.zeros(len(spec.segment(i).entries), dtype=torch.int64)
                             for i in range(len(spec.sharded))])
    return tree_map(lambda p: zero_count(), params)


def is_count(t: torch.Tensor) -> bool:
    """Whether ``t`` is an optimizer's step count (``steps``, ``count``: int64, small, the same on
    every rank, kept in RAM), not a tensor laid out like the parameters."""
    return not t.is_floating_point()


def counts_like(steps, p_leaves, spec) -> list[torch.Tensor]:
    leaves, tspec = tree_flatten(steps)
    if tspec != spec:
        raise ValueError(f"opt_state.steps does not have the structure of params:\n  steps: {tspec}\n  params: {spec}")
    return leaves


def live_by_step(params, grads, steps, info: GradInfo | None) -> dict[int, list[tuple[int, Part]]]:
    """What to update, grouped by the updates each part has had (one group in all but rare steps),
    as ``(leaf, part)``; the counts of what is updated advance.

    A leaf without a gradient is left out. A unit's leaf (one count per parameter) is one part when
    every parameter in it got a gradient (``info.live``) and all have had as many updates, as in
    all but rare steps; else each run of neighbouring parameters that did and have is a part of its
    own, and a parameter without a gradient is left out: no decay, no moment update, its count kept,
    as ``torch.optim`` skips a parameter whose ``.grad`` is None. A parameter counts even where this
    rank's slice holds none of it, so every rank keeps the same counts.
    """
    groups: dict[int, list[tuple[int, Part]]] = {}
    live = None if info is None else info.live
    for i, (g, n) in enumerate(zip(grads, steps)):
        if g is None:
            continue
        if n.dim() == 0:  # one count for the whole leaf
            groups.setdefault(int(n), []).append((i, None))
            n.add_(1)
            continue
        got = (True,) * n.numel() if live is None else live[i]
        for count, part in _runs(params.parameter_ranges(i), got, n.tolist()):
            groups.setdefault(count, []).append((i, part))
        n.add_(torch.tensor(got, dtype=torch.int64))
    return groups


def _runs(ranges, got, counts) -> list[tuple[int, Part]]:
    """``(count, part)`` of one unit's leaf: runs of neighbouring parameters in it (``ranges``: each
    parameter's elements in the leaf, empty where it holds none) that got a gradient and have had
    ``count`` updates; the whole leaf (padding too, as zeros stay zeros) when that is one run of all."""
    runs: list[list[int]] = []
    skipped = False
    for (start, stop), on, count in zip(ranges, got, counts):
        if start == stop:
            continue
        if not on:
            skipped = True
        elif runs and runs[-1][0] == count and runs[-1][2] == start:
            runs[-1][2] = stop
        else:
            runs.append([count, start, stop])
    if len(runs) == 1 and not skipped:
        return [(runs[0][0], None)]
    return [(count, (start, stop)) for count, start, stop in runs]
