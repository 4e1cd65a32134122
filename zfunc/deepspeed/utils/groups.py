"""``deepspeed.utils.groups``: DeepSpeed's process groups as its clients read them. zfunc shards
over one data-parallel group, the world: its size and this rank's place in it are real; model
(tensor) and sequence parallelism have one rank (size 1, rank 0, as DeepSpeed reports them
without an ``mpu``); asking for a sequence-parallel or expert group is refused, named (DeepSpeed
raises there too without one)."""
from __future__ import annotations

import torch.distributed as torch_dist

from ... import dist

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_rank", "get_model_parallel_world_size"]


def _get_data_parallel_group():
    """The world's group (None without a process group)."""
    return torch_dist.group.WORLD if torch_dist.is_initialized() else None


def _get_data_parallel_world_size() -> int:
    return dist.world_size()


def _get_data_parallel_rank() -> int:
    return dist.rank()


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    raise NotImplementedError("deepspeed.utils.groups: sequence parallelism (DeepSpeed Ulysses) is not supported "
                              "by zfunc, so there is no sequence-parallel group; leave sequence_parallel_size / "
                              "sp_size at 1")


def _get_expert_parallel_group(group_name):
    raise NotImplementedError("deepspeed.utils.groups: expert parallelism (DeepSpeed MoE) is not supported by zfunc")


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
get_model_parallel_world_size = _get_model_parallel_world_size


def get_model_parallel_rank() -> int:
    return 0
