"""``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``: the class DeepSpeed's ZeRO optimizers
derive from, which clients test engines' optimizers against (Lightning Fabric's checkpoint load asks
``isinstance(item, (Optimizer, DeepSpeedOptimizer))`` to decide whether to load optimizer states).
zfunc's ``engine.optimizer`` (zfunc.engine.handles.OptimizerHandle) is registered as one."""
from abc import ABC

from ...engine.handles import OptimizerHandle


class DeepSpeedOptimizer(ABC):
    """What an engine's optimizer is an instance of."""


DeepSpeedOptimizer.register(OptimizerHandle)
