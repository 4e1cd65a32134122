"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` (zfunc's) and the loader
``deepspeed.initialize`` builds from ``training_data`` (zfunc.deepspeed.data)."""
from ...engine import RepeatingLoader
from ..data import DataLoader as DeepSpeedDataLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]
