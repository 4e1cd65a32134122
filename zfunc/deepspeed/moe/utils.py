"""``deepspeed.moe.utils``: param-group helpers scripts call around DeepSpeed's MoE layers."""
from __future__ import annotations

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param) -> bool:
    """Whether ``param`` is an expert's (DeepSpeed's MoE layers mark theirs ``allreduce=False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """``param_groups`` (a dict, or a list or tuple of them) as a list. DeepSpeed moves expert
    parameters into groups of their own; zfunc has none (``layer.MoE`` is refused), so the groups are
    returned as they are, and an expert parameter made elsewhere is refused."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for group in groups:
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError("split_params_into_different_moe_groups_for_optimizer: a parameter is marked "
                                      "as an expert's (allreduce=False); DeepSpeed's expert parallelism is not "
                                      "supported by zfunc")
    return groups
