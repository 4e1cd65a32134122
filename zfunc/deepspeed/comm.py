"""The process group as DeepSpeed scripts reach it (``deepspeed.init_distributed``,
``deepspeed.comm.get_rank()``...): torch.distributed through zfunc.dist, gloo on the CPU and nccl
on CUDA unless the script names a backend.

Launched by torchrun or DeepSpeed's launcher (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` in the
environment), ``init_distributed`` starts the default group; a group the script already started
is used as it is. A single process started without a launcher trains alone with no group, as
``zf.dist`` does (DeepSpeed would look for MPI there); ``get_rank()`` is then 0 and
``get_world_size()`` 1.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as torch_dist

from .. import dist

__all__ = ["barrier", "get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_initialized"]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed's ``init_distributed``: the default process group (see the module docstring).
    ``dist_backend``: ``"gloo"``, ``"nccl"``...; None picks nccl where CUDA is, else gloo.
    ``init_method`` with ``rank`` and ``world_size`` starts a group without a launcher."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False) but no process group exists: start one "
                           "(torch.distributed.init_process_group) or leave dist_init_required at None")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if init_method is not None and rank >= 0 and world_size >= 1:
        kw = {} if timeout is None else {"timeout": timeout}
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))))
        torch_dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kw)
        return
    if "WORLD_SIZE" in os.environ and timeout is not None:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch_dist.init_process_group(backend, timeout=timeout)
        return
    dist.init(backend)


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.rank(group)


def get_world_size(group=None) -> int:
    return dist.world_size(group)


def get_local_rank() -> int:
    """``LOCAL_RANK`` from the launcher; without one, the global rank (one machine)."""
    return int(os.environ.get("LOCAL_RANK", get_rank()))


def barrier(group=None) -> None:
    """Wait for every rank (zfunc.dist's barrier, counted as one; nothing to wait for alone)."""
    dist.barrier(group)
