"""Pipeline parallelism: a ``PipelineModule`` of layer specs built lazily per stage (``module``),
the instruction lists of GPipe and 1F1B (``schedules``), the point-to-point transfers between
stages (``link``), and the engine that interprets them (``interpreter``), composed with data
parallelism."""
from . import schedules
from .interpreter import PipelineEngine
from .module import LayerSpec, PipelineModule, TiedLayerSpec, balance

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "TiedLayerSpec", "balance", "schedules"]
