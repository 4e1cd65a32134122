"""``deepspeed.pipe``: zfunc's pipeline (zfunc.pipeline, docs/pipeline.md) under DeepSpeed's names.

``PipelineModule`` takes DeepSpeed's arguments and is zfunc's ``PipelineModule`` (so
``deepspeed.initialize`` makes it zfunc's ``PipelineEngine``); ``LayerSpec`` and ``TiedLayerSpec``
are zfunc's. What zfunc's pipeline lacks is refused, named: a ``topology`` (pipeline x data
parallel is the world split by ``num_stages``; no tensor parallelism), activation checkpointing
of the layers (``activation_checkpoint_interval`` > 0), per-layer seeds (``seed_layers``).

As DeepSpeed's, it builds this rank's stage when constructed in a process group (a ``LayerSpec``'s
layer is made then, drawing from the RNG where DeepSpeed's draws), and ``parameters()`` /
``named_parameters()`` are that stage's (what scripts pass as ``model_parameters``); the engine
trains that same stage.
"""
from __future__ import annotations

from .. import dist
from ..pipeline import LayerSpec, TiedLayerSpec
from ..pipeline import PipelineModule as _Pipeline

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class PipelineModule(_Pipeline):
    """DeepSpeed's ``PipelineModule(layers, num_stages=None, topology=None, loss_fn=None,
    seed_layers=False, seed_fn=None, base_seed=1234, partition_method="parameters",
    activation_checkpoint_interval=0, activation_checkpoint_func=..., checkpointable_layers=None,
    dynamic_shape=False)`` on zfunc's pipeline: see the module docstring."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
                 base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
                 activation_checkpoint_func=None, checkpointable_layers=None, dynamic_shape=False):
        if topology is not None:
            raise NotImplementedError("PipelineModule(topology=...): DeepSpeed's process topologies (pipeline x "
                                      "tensor x data parallel grids) are not supported; give num_stages (the data-"
                                      "parallel degree is the world size divided by it)")
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages (or, in DeepSpeed, a topology)")
        if activation_checkpoint_interval:
            raise NotImplementedError(f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval}): "
                                      "activation checkpointing of pipeline layers is not supported; use 0")
        if seed_layers or seed_fn is not None:
            raise NotImplementedError("PipelineModule(seed_layers=True / seed_fn=...): per-layer seeding is not "
                                      "supported; seed once (torch.manual_seed) before building the layers")
        if loss_fn is None:
            raise NotImplementedError("PipelineModule(loss_fn=None): zfunc's pipeline trains on the loss the last "
                                      "stage computes; give loss_fn (e.g. torch.nn.CrossEntropyLoss())")
        super().__init__(layers, num_stages, loss_fn, partition_method=partition_method)
        self._stage = None
        if dist.is_initialized():
            world = dist.world_size()
            if world % num_stages == 0:  # else the engine's grid refuses it, naming both
                self._stage = super().build(dist.rank() // (world // num_stages))

    def build(self, stage: int):
        """This rank's stage as built at construction; another stage (or none built), built now."""
        if self._stage is not None and self._stage.stage == stage:
            return self._stage
        return super().build(stage)

    def _own(self):
        if self._stage is None:
            raise RuntimeError("PipelineModule.parameters(): this rank's stage is built in a process group; call "
                               "deepspeed.init_distributed() before building the PipelineModule, as in DeepSpeed")
        return self._stage

    def parameters(self, recurse: bool = True):
        return self._own().parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._own().named_parameters(*args, **kwargs)
