"""How a flat buffer splits over the ranks of a group: the one place that knows.

A unit's flat buffer is padded to a multiple of the world size W, so that it
splits into W equal shards; rank r holds elements ``[r*n, (r+1)*n)``. A rank's
*home* part of a buffer is its shard when the buffer is sharded, else all of
it. Every module that pads, slices or sizes a shard asks here.
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


def shard_start(rank: int, shard_numel: int) -> int:
    """Where rank ``rank``'s shard of ``shard_numel`` elements starts in the padded buffer."""
    return rank * shard_numel


def owner(pos: int, shard_numel: int) -> tuple[int, int]:
    """The rank whose shard (of ``shard_numel`` elements) holds element ``pos``, and where in it."""
    return divmod(pos, shard_numel)


def home_numel(padded: int, world: int, sharded: bool) -> int:
    """Elements a rank holds of a buffer of ``padded``: its shard when ``sharded``, else all."""
    return shard_numel(padded, world) if sharded else padded


def shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the 1-D ``flat``: a view, so writing it writes ``flat``."""
    n = shard_numel(flat.numel(), world)
    start = shard_start(rank, n)
    return flat[start : start + n]
