"""A composition as plain data, and where it puts each unit: the estimator's reading of the ZeRO
stages, mixed precision, accumulation and offload (zfunc.transforms), checked against the states
they build (tests/estimator)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layout

OFFLOADS = (None, "cpu", "nvme")


@dataclass(frozen=True)
class Composition:
    """What a step is made of. ``stage``: ZeRO's 0-3 (0: ``train_step`` alone, replicated).
    ``dtype``: ``mixed_precision``'s compute and storage dtype (None: the model's own, no fp32
    master copy); ``reduce_dtype``: the dtype gradients are reduced in under it (fp32, its default).
    ``offload``: ``"cpu"`` (``offload_cpu``: the optimizer state and its update in host memory;
    ``offload_params``: zero3's parameter shards there too) or ``"nvme"`` (``offload_nvme``:
    parameters and optimizer state in swap files; ``offload_params=False`` keeps the parameters).
    ``state_dtype``: Adam's moments' storage (``zf.optim.adamw(state_dtype=)``: fp32, or bf16).
    ``accumulate``: micro-batches a step; ``micro_batch_tokens``: tokens each rank runs per
    micro-batch. ``hybrid``: shard within a node, replicate across nodes (``zero3(mesh=)``); else one
    flat group of every rank. ``persistence_threshold``: zero3's (units smaller stay whole).
    ``reshard_after_forward``: zero3's hpZ, ``k`` ranks (a part of the shard group, within a node)
    each unit stays sharded over from its forward to its backward, which gathers it among them."""

    stage: int = 3
    dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    offload: str | None = None
    offload_params: bool | None = None
    state_dtype: torch.dtype = torch.float32
    accumulate: int = 1
    micro_batch_tokens: int = 2048
    hybrid: bool = False
    persistence_threshold: int = 0
    reshard_after_forward: int | None = None

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Composition.stage must be 0, 1, 2 or 3 (ZeRO's stages), got {self.stage!r}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"Composition.offload must be None, 'cpu' or 'nvme', got {self.offload!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"Composition.dtype must be a floating torch dtype (torch.bfloat16) or None, "
                             f"got {self.dtype!r}")
        if self.state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Composition.state_dtype must be torch.float32 or torch.bfloat16 (Adam's moments), "
                             f"got {self.state_dtype!r}")
        for name in ("accumulate", "micro_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Composition.{name} must be a positive int, got {value!r}")
        if self.offload is not None and self.stage == 0:
            raise ValueError("Composition: offload needs a ZeRO stage (1-3), as zf.offload_cpu and offload_nvme do")
        k = self.reshard_after_forward
        if k is not None and (self.stage != 3 or not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"Composition.reshard_after_forward is zero3's hpZ group size, a positive int with "
                             f"stage=3; got {k!r} with stage={self.stage}")
        if self.hybrid and self.stage == 0:
            raise ValueError("Composition.hybrid shards within a node: give a ZeRO stage (1-3)")

    @property
    def params_offloaded(self) -> bool:
        """Whether parameter shards leave the device (zero3 only: stages 1 and 2 keep them whole)."""
        if self.offload is None or self.stage != 3:
            return False
        default = self.offload == "nvme"  # offload_nvme(params=True), offload_cpu(params=False)
        return default if self.offload_params is None else bool(self.offload_params)


@dataclass(frozen=True)
class UnitPlacement:
    """One unit under a composition over a shard group of ``shard`` ranks: its padded length, what
    this rank holds of it, and how it moves."""

    padded: int  # the trainable flat buffer, padded to a multiple of the shard group
    frozen_padded: int
    params_sharded: bool
    grads_sharded: bool  # reduce-scattered (else all-reduced)
    opt_sharded: bool
    shard: int

    def held(self, numel: int, sharded: bool) -> int:
        return numel // self.shard if sharded else numel

    @property
    def local(self) -> int:
        """Elements of the unit this rank's optimizer updates."""
        return self.held(self.padded, self.opt_sharded)


def place(unit, comp: Composition, shard: int) -> UnitPlacement:
    """Where ``comp`` puts ``unit`` (a ``ModelShape`` unit) over ``shard`` ranks (zf.zero1-3's rules:
    zfunc/transforms/zero.py)."""
    params_sharded = comp.stage == 3 and unit.trainable + unit.frozen >= comp.persistence_threshold
    return UnitPlacement(layout.padded_numel(unit.trainable, shard), layout.padded_numel(unit.frozen, shard),
                         params_sharded, comp.stage >= 2, comp.stage >= 1, shard)
