"""``deepspeed.moe``: mixture of experts is not in zfunc. ``layer.MoE`` is refused by name;
``utils.split_params_into_different_moe_groups_for_optimizer`` and ``utils.is_moe_param`` are here
because scripts import them whether or not they build experts (DeepSpeedExamples' CIFAR script),
and without expert parameters they change nothing."""
from . import layer, utils

__all__ = ["layer", "utils"]
