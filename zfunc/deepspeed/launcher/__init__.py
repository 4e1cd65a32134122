"""``deepspeed.launcher``: ``runner.DEEPSPEED_ENVIRONMENT_NAME``. zfunc has no launcher of its own:
start ranks with ``torchrun`` (or ``accelerate launch``), which set what ``init_distributed``
reads."""
from . import runner

__all__ = ["runner"]
