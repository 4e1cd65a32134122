"""DeepSpeed's command-line flags (``deepspeed.add_config_arguments``), as DeepSpeed 0.19 adds them:
``--deepspeed``, ``--deepspeed_config`` and their deprecated ``--deepscale`` twins. The launcher's
``--local_rank`` is the script's own flag in DeepSpeed too."""
from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the group "DeepSpeed" with DeepSpeed's flags to ``parser``; returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
