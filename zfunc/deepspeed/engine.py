"""The engine ``zfunc.deepspeed.initialize`` returns: zfunc's ``Engine`` where DeepSpeed's semantics
differ from ``zf.initialize``'s.

One difference: ``load_checkpoint`` leaves the random number generators as they are, as
DeepSpeed's does (it saves no RNG state), where zfunc's checkpoints put back the RNG state of
the save so that a resumed run draws what the uninterrupted one would have. A DeepSpeed script
that seeds, builds a fresh model and loads gets DeepSpeed's dropout masks after the load.
"""
from __future__ import annotations

import torch

from ..engine.engine import Engine


class DeepSpeedEngine(Engine):
    """See the module docstring."""

    def load_checkpoint(self, load_dir: str, tag: str | None = None, *args, **kwargs):
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            return super().load_checkpoint(load_dir, tag, *args, **kwargs)
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
