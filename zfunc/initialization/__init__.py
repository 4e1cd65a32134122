"""Where an engine is picked for a model and a DeepSpeed-style config: ``zf.initialize`` and
``zfunc.deepspeed.initialize`` both come here, so a ``PipelineModule`` and a plain model are told
apart, and the config read for its data-parallel width, in one place.
"""
from .engines import config_for, engine_for, initialize

__all__ = ["config_for", "engine_for", "initialize"]
