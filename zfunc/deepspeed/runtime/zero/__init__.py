"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters`` (zfunc.deepspeed.zero),
``partition_parameters`` and ``offload_config``."""
from ...zero import GatheredParameters, Init
from . import offload_config, partition_parameters

__all__ = ["GatheredParameters", "Init", "offload_config", "partition_parameters"]
