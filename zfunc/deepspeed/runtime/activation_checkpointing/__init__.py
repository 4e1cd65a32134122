"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` (also ``deepspeed.checkpointing``)."""
from . import checkpointing

__all__ = ["checkpointing"]
