"""Process groups and the few collectives zfunc uses, all in one place.

W = 1 needs no process group at all. Under torchrun, ``init()`` reads the
environment and picks gloo on CPU, nccl on CUDA. Every collective in the
library goes through this module, so the torch API it depends on lives here.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

Group = "dist.ProcessGroup | None"


def init(backend: str | None = None) -> None:
    """Start the default process group from torchrun's environment, if any.

    A no-op when already initialized or when not launched by torchrun.
    """
    if is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def shutdown() -> None:
    """Barrier, then destroy the default group (gloo may abort at exit otherwise)."""
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def all_gather(shard: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's equally sized 1-D ``shard`` into one new tensor."""
    w = world_size(group)
    if w == 1:
        return shard
    out = torch.empty(shard.numel() * w, dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return out


def reduce_scatter_mean(full: torch.Tensor, group=None) -> torch.Tensor:
    """Mean over ranks of ``full`` (1-D, length divisible by W), this rank's slice."""
    w = world_size(group)
    if w == 1:
        return full
    out = torch.empty(full.numel() // w, dtype=full.dtype, device=full.device)
    dist.reduce_scatter_single(out, full.contiguous(), group=group)
    return out.div_(w)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks, in place; returns ``t``."""
    if world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def all_reduce_mean(t: torch.Tensor, group=None) -> torch.Tensor:
    """Mean over ranks, in place; returns ``t``."""
    w = world_size(group)
    if w > 1:
        dist.all_reduce(t, group=group)
        t.div_(w)
    return t


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy group rank ``src``'s ``t`` to every rank, in place; returns ``t``."""
    if world_size(group) > 1:
        dist.broadcast(t, group_src=src, group=group)
    return t


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    w = world_size(group)
    if w == 1:
        return [obj]
    out = [None] * w
    dist.all_gather_object(out, obj, group=group)
    return out
