"""The process group as DeepSpeed scripts reach it (``deepspeed.init_distributed``,
``deepspeed.comm.get_rank()``...): torch.distributed through zfunc.dist, gloo on the CPU and nccl
on CUDA unless the script names a backend.

The script's own collectives (``all_reduce``, ``broadcast``, ``all_gather``, ...) are
torch.distributed's, DeepSpeed's names and arguments; with no group (one process, no launcher)
they act as over one rank (the tensor is left as it is, gathered into one slot). DeepSpeed's
comms-logging arguments (``prof``, ``log_name``, ``debug``) are accepted and change nothing.

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

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
           "destroy_process_group", "get_global_rank", "get_local_rank", "get_rank", "get_world_size",
           "init_distributed", "is_available", "is_initialized", "new_group", "reduce_scatter_tensor"]

ReduceOp = torch_dist.ReduceOp


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


def is_available() -> bool:
    return torch_dist.is_available()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    return group_rank if group is None else torch_dist.get_global_rank(group, group_rank)


def new_group(ranks):
    return torch_dist.new_group(ranks)


def destroy_process_group(group=None) -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group(group)


def _alone() -> bool:
    return not torch_dist.is_initialized()


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **comms_logging):
    return None if _alone() else torch_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op: bool = False, **comms_logging):
    return None if _alone() else torch_dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, **comms_logging):
    if _alone():
        tensor_list[0].copy_(tensor)
        return None
    return torch_dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False, **comms_logging):
    if _alone():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return torch_dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **comms_logging):
    if _alone():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return torch_dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)
