"""State held for some parameters only: ``zf.optim.multi``'s members.

A member of ``multi`` updates only the parameters labelled for it, so it keeps the state laid out like
the parameters (AdamW's moments, SGD's and Muon's momentum) for those only: each unit's leaf holds,
one after another, the member's entries' elements of the parameters' leaf (this rank's shard under
ZeRO, a piece of it under offload_nvme), and the node's ``ParamsSpec.held`` says which entries
(zfunc.tree: ``held_runs``, ``expand_held``, ``compact_held``). Checkpoints write such a leaf laid
out like the parameters (zeros for the others) and read it back compacted, so a checkpoint is the
same whichever way the state is held, and loads at any world size; offload_nvme reads and writes
the held elements of each piece.
"""
from __future__ import annotations

import bisect
from dataclasses import replace

import torch

from ..tree import Params, held_count, held_runs, holding


def held_zeros(params: Params, chosen, make) -> Params:
    """``make(p)`` (zeros like ``p``, in the state's dtype) for the elements of the entries ``chosen``
    selects only, each unit's leaf of ``params`` compacted to them."""
    spec = holding(params.spec, chosen)
    leaves = []
    for i, leaf in enumerate(params.leaves):
        if leaf is None:
            leaves.append(None)
            continue
        lo = params.leaf_start(i)
        n = held_count(spec, i, lo, lo + leaf.numel())
        leaves.append(make(torch.empty(n, dtype=leaf.dtype, device=leaf.device)))
    return Params(spec, leaves)


def is_held(tree) -> bool:
    return isinstance(tree, Params) and tree.spec.held is not None


def check_held(tree, what: str, params) -> None:
    """A held state ``tree`` matches ``params``: the same units and layout."""
    if not isinstance(params, Params) or replace(tree.spec, held=None) != replace(params.spec, held=None):
        raise ValueError(f"{what} holds state for some parameters only, laid out for other parameters than those "
                         "given: make the state with the optimizer's init over the same parameters")


class HeldParts:
    """A held state's part for each part of the parameters' leaves an update touches."""

    def __init__(self, spec, params: Params, p_leaves):
        self.spec, self.params, self.p = spec, params, p_leaves
        self._runs: dict[int, tuple[list[int], list[int], list[int]]] = {}

    def runs(self, i: int) -> tuple[list[int], list[int], list[int]]:
        """Leaf ``i``'s held runs in the leaf's elements: their starts, their ends, and how many held
        elements come before each (worked out once per update)."""
        if i not in self._runs:
            lo = self.params.leaf_start(i)
            starts, ends, before, n = [], [], [], 0
            for a, b in held_runs(self.spec, i, lo, lo + self.p[i].numel()):
                starts.append(a - lo)
                ends.append(b - lo)
                before.append(n)
                n += b - a
            self._runs[i] = (starts, ends, before)
        return self._runs[i]

    def count(self, i: int, x: int) -> int:
        """Held elements of leaf ``i`` before its element ``x``."""
        starts, ends, before = self.runs(i)
        k = bisect.bisect_right(starts, x) - 1
        return 0 if k < 0 else before[k] + min(x, ends[k]) - starts[k]

    def groups(self, groups: dict) -> dict:
        """``groups`` (key -> [(leaf, part)]) with a whole leaf (``None``) cut into its held runs."""
        out = {}
        for key, parts in groups.items():
            got = []
            for i, part in parts:
                if part is None:
                    starts, ends, _ = self.runs(i)
                    got += [(i, (a, b)) for a, b in zip(starts, ends)]
                else:
                    got.append((i, part))
            if got:
                out[key] = got
        return out

    def part(self, i: int, part: tuple[int, int]) -> tuple[int, int]:
        """Where the parameters' leaf ``i``'s elements ``part`` lie in the held leaf."""
        a, b = self.count(i, part[0]), self.count(i, part[1])
        if b - a != part[1] - part[0]:
            raise ValueError(f"an update of unit {i}'s elements {part} covers parameters its state does not hold "
                             "(zf.optim.multi marks the other members' parameters as without gradient)")
        return a, b
