"""The DeepSpeed-style engine: a JSON config (``config``) composed into a step (``compose``),
run by a loop (``Engine`` on the shared ``loop.Loop``): ``train_batch``, the imperative
``engine(batch)`` / ``backward`` / ``step``, checkpoints."""
from .engine import Engine, RepeatingLoader

__all__ = ["Engine", "RepeatingLoader"]
