"""How a flat buffer splits over the ranks of a group: the one place that knows.

A unit's flat buffer is padded to a multiple of the world size W, so that it
splits into W equal shards; rank r holds elements ``[r*n, (r+1)*n)``. Every
module that pads, slices or sizes a shard asks here.
"""
from __future__ import annotations

import torch


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``world`` (0 stays 0)."""
    return -(-numel // world) * world if numel else 0


def shard_numel(padded: int, world: int) -> int:
    """Elements in each rank's shard of a buffer of ``padded`` elements."""
    if padded % world:
        raise ValueError(f"a buffer of {padded} elements does not split over {world} ranks")
    return padded // world


def shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the 1-D ``flat``: a view, so writing it writes ``flat``."""
    n = shard_numel(flat.numel(), world)
    return flat[rank * n : (rank + 1) * n]
