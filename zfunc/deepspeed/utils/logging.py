"""``deepspeed.utils.logging``: DeepSpeed's logger (named ``DeepSpeed``) and ``log_dist``, logging
from chosen ranks. Lightning's DeepSpeed strategy sets ``deepspeed.utils.logging.logger``'s level."""
from __future__ import annotations

import logging

from ... import dist

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                            "%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks in ``ranks`` (all with None or -1 among them)."""
    rank = dist.rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
