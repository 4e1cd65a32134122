"""``deepspeed.runtime.engine``: the engine class ``deepspeed.initialize`` returns (zfunc's, with
DeepSpeed's methods: zfunc.deepspeed.engine)."""
from ..engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
