"""``deepspeed.launcher.runner``: the name of the file of environment variables DeepSpeed's
launcher exports to every node (transformers reads it). Launching itself is refused: use torchrun."""
from __future__ import annotations

import os

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def main(args=None):
    raise NotImplementedError("the deepspeed launcher (deepspeed.launcher.runner.main, the `deepspeed` command) is "
                              "not offered by zfunc: start the ranks with torchrun --nproc_per_node N script.py "
                              "(or accelerate launch); init_distributed reads what it sets")
