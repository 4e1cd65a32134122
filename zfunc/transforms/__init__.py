"""Step transforms: each takes a ``Step`` and returns one that places, shards, casts, offloads or
accumulates differently (zfunc.transform says what a transform contributes). They stand on the
core and know nothing of the engines."""
from .accumulate import accumulate
from .jit import jit
from .loss_scale import LossScaler
from .offload.cpu import offload_cpu
from .offload.nvme import offload_nvme
from .offload.planning import plan_offload
from .precision import mixed_precision
from .recompute import recompute
from .zero import zero1, zero2, zero3

__all__ = ["LossScaler", "accumulate", "jit", "mixed_precision", "offload_cpu", "offload_nvme", "plan_offload", "recompute", "zero1", "zero2", "zero3"]
