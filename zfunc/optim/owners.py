"""Owners: which rank updates each whole parameter of a whole-tensor optimizer (zfunc.optim.whole).

A unit's flat buffer is cut into W equal shards (zfunc.layout); an elementwise optimizer updates any
slice, but Muon, Adafactor or any ``torch.optim`` class run through ``from_torch`` need each
parameter whole. Each such parameter gets one *owner* rank, the same on every rank, chosen from the
layout alone (so it is known when the state is made and at every update):

* a parameter that lies inside one rank's shard is owned by that rank: its reduce-scattered gradient
  is already whole there, and its updated values go back through the usual all-gather, with no
  collective of the optimizer's own. The step lays each unit out so (zfunc.tree's owner layout,
  ``owner_offsets``: the optimizer's whole parameters, from ``zfunc.optim.whole.whole_params``, each
  kept inside one of the W equal shards, a gap of zeros before one that would cross a shard's end,
  each one's shard chosen so that the ranks' costs, ``whole_params(opt).cost(name, shape)``, stay
  even across the units), wherever that adds at most ``zfunc.tree.MAX_OWNER_PADDING`` of the unit's
  elements;
* a parameter the shards still cut (a unit the layout could not cut cheaply: one smaller than its
  owners, one matrix larger than a fair shard) is given to the rank with the least work so far, largest first, where
  work is the optimizer's cost for that shape (Newton-Schulz's FLOPs for Muon) summed over what each
  rank already owns. Its unit is then gathered to the owners and the results summed back
  (``OwnedUnit``: one all-gather and one all-reduce per such unit, counted in ``metrics["comm"]``).

The state laid out like the parameters (Muon's momentum) is sharded with them; the small rest
(``slots``: Adafactor's row and column statistics, torch's ``step``) is kept on every rank, its
owner's values shared after each update (zfunc.optim.whole).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

Cost = Callable[[tuple[int, ...]], float]


def numel_cost(shape: tuple[int, ...]) -> float:
    """The default cost of a whole-tensor update: its elements."""
    return float(math.prod(shape))


@dataclass(frozen=True)
class Placed:
    """One whole parameter of a unit: where it lies in the unit's flat buffer and who owns it."""

    index: int  # its entry's position in the unit
    name: str
    shape: tuple[int, ...]
    start: int  # elements [start, stop) of the unit's flat buffer
    stop: int
    owner: int
    cut: bool  # the shards cut it: its unit is gathered to the owners


def assign(units: Sequence[Sequence[tuple[int, str, tuple[int, ...], int, int]]], shard_numels: Sequence[int | None],
           world: int, cost: Cost) -> list[list[Placed]]:
    """Owners for every unit's whole parameters. ``units``: per unit, ``(index, name, shape, start,
    stop)`` of the parameters updated whole; ``shard_numels``: per unit, its shard's elements
    (``None``: the unit is not sharded, every rank updates all of it: owner -1)."""
    load = [0.0] * world
    out: list[list[Placed]] = [[] for _ in units]
    cut: list[tuple[float, int, tuple]] = []
    for u, (entries, n) in enumerate(zip(units, shard_numels)):
        for k, (index, name, shape, start, stop) in enumerate(entries):
            if n is None or world == 1:
                out[u].append(Placed(index, name, shape, start, stop, -1 if n is None else 0, False))
                continue
            first, last = start // n, (stop - 1) // n
            if first == last:
                load[first] += cost(shape)
                out[u].append(Placed(index, name, shape, start, stop, first, False))
            else:
                out[u].append(None)  # filled below
                cut.append((cost(shape), u, (k, index, name, shape, start, stop)))
    for c, u, (k, index, name, shape, start, stop) in sorted(cut, key=lambda x: (-x[0], x[1], x[2][0])):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += c
        out[u][k] = Placed(index, name, shape, start, stop, owner, True)
    return out


def loads(placed: list[list[Placed]], world: int, cost: Cost) -> list[float]:
    """Each rank's share of the work (for reports and tests)."""
    out = [0.0] * world
    for unit in placed:
        for p in unit:
            if p.owner >= 0:
                out[p.owner] += cost(p.shape)
    return out
