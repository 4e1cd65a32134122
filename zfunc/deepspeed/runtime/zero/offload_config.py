"""``deepspeed.runtime.zero.offload_config``'s enums, which scripts pass to
``engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)``
(DeepSpeedExamples' offload_states script, RL frameworks between their phases): the same names and
values as DeepSpeed's. zfunc.residency.parts maps the state types to zfunc's parts; the offload
sections of a config are read by zfunc.engine.config, not through classes here."""
from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where ``offload_states`` moves the state (``none``: nowhere)."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of state ``offload_states(include=...)`` names."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
