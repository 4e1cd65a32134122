"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters`` (zfunc.deepspeed.zero) and
``partition_parameters``."""
from ...zero import GatheredParameters, Init
from . import partition_parameters

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
