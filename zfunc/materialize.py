"""Materializing units: gather in forward, send gradients home in backward.

``Materialize`` is one autograd Function per unit use: forward turns the
stored leaf (a shard, or the full buffer) into the full flat buffer; backward
reduces the full gradient back to the leaf's representation (reduce-scatter or
all-reduce, mean over ranks) the moment autograd is done with the unit.

Gathered buffers are never kept alive for backward: a saved-tensor hook
replaces any saved view of one with a small handle, and the unpack hook
re-gathers the unit (once per backward use; released when the unit's own
backward runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dist
from .tree import Params


class _Unit:
    """A unit's leaf plus what materializing it needs; lives for one forward/backward."""

    __slots__ = ("index", "leaf", "anchor", "sharded_leaf", "grads_sharded", "group", "tracker")

    def __init__(self, index, leaf, sharded_leaf, grads_sharded, group, tracker, anchor=None):
        self.index = index
        self.leaf = leaf
        self.anchor = leaf if anchor is None else anchor
        self.sharded_leaf = sharded_leaf
        self.grads_sharded = grads_sharded
        self.group = group
        self.tracker = tracker

    @property
    def gathers(self) -> bool:
        """Whether materializing makes a new buffer (a sharded leaf with W > 1)."""
        return self.sharded_leaf and dist.world_size(self.group) > 1

    def gather(self, data: torch.Tensor) -> torch.Tensor:
        return dist.all_gather(data, self.group) if self.sharded_leaf else data

    def reduce(self, grad_full: torch.Tensor) -> torch.Tensor:
        if self.grads_sharded:  # stages 2 and 3: keep only this rank's slice
            return dist.reduce_scatter_mean(grad_full, self.group)
        if dist.world_size(self.group) == 1:
            return grad_full
        return dist.all_reduce_mean(grad_full.clone(), self.group)


class Materialize(torch.autograd.Function):
    """``anchor`` is what autograd differentiates: the leaf itself, or for a full
    leaf with sharded gradients (stage 2) a shard-shaped stand-in, since a
    gradient must have its input's shape."""

    @staticmethod
    def forward(anchor: torch.Tensor, unit: _Unit) -> torch.Tensor:
        full = unit.gather(unit.leaf.detach())
        return full if full is not unit.leaf else full.view_as(full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.unit = inputs[1]

    @staticmethod
    def backward(ctx, grad_full):
        unit: _Unit = ctx.unit
        unit.tracker.release_backward(unit)
        return unit.reduce(grad_full), None


@dataclass
class _SavedView:
    """Stands in for a saved view of a gathered buffer until backward needs it."""

    unit: _Unit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class Tracker:
    """Live gathered buffers of one forward/backward, and the peak bytes they reach."""

    def __init__(self):
        self.live: dict[int, tuple[_Unit, torch.Tensor]] = {}  # storage ptr -> unit, buffer
        self.backward_cache: dict[_Unit, torch.Tensor] = {}  # unit -> re-gathered buffer
        self.current = 0
        self.peak = 0

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def gathered(self, unit: _Unit, buf: torch.Tensor) -> None:
        if unit.gathers:
            self.live[buf.untyped_storage().data_ptr()] = (unit, buf)
            self._add(buf.numel() * buf.element_size())

    def released(self, buf: torch.Tensor) -> None:
        entry = self.live.pop(buf.untyped_storage().data_ptr(), None)
        if entry is not None:
            self.current -= buf.numel() * buf.element_size()

    def pack(self, t: torch.Tensor):
        if not self.live or t.layout != torch.strided:
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self.live.get(ptr)
        if entry is None:
            return t
        return _SavedView(entry[0], t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved):
        if not isinstance(saved, _SavedView):
            return saved
        unit = saved.unit
        buf = self.backward_cache.get(unit)
        if buf is None:
            with torch.no_grad():
                buf = unit.gather(unit.leaf.detach())
            self.backward_cache[unit] = buf
            self._add(buf.numel() * buf.element_size())
        return buf.as_strided(saved.size, saved.stride, saved.offset)

    def release_backward(self, unit: _Unit) -> None:
        buf = self.backward_cache.pop(unit, None)
        if buf is not None:
            self.current -= buf.numel() * buf.element_size()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def close(self) -> None:
        self.backward_cache.clear()
        self.live.clear()
        self.current = 0


class Units:
    """Materializes the units of a ``Params`` node on demand, with reference counts."""

    def __init__(self, params: Params, tracker: Tracker, differentiable: bool = False):
        spec = params.spec
        self.spec = spec
        self.tracker = tracker
        w = dist.world_size(spec.group)
        self.units = []
        for i, (leaf, sharded, place) in enumerate(zip(params.leaves, spec.sharded, spec.placements)):
            leaf = leaf.detach()
            anchor = None
            if differentiable and place.grads_sharded and not sharded and w > 1:
                anchor = torch.empty_strided((leaf.numel() // w,), (0,), dtype=leaf.dtype, device=leaf.device)
            elif differentiable:
                leaf.requires_grad_()
            self.units.append(_Unit(i, leaf, sharded, place.grads_sharded, spec.group, tracker, anchor))
            if anchor is not None:
                anchor.requires_grad_()
        self.anchors = [u.anchor for u in self.units]
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.refs: dict[int, int] = {}

    def acquire(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self.views:
            unit = self.units[index]
            if unit.leaf.numel() == 0:
                full = unit.leaf
            else:
                full = Materialize.apply(unit.anchor, unit)
                self.tracker.gathered(unit, full)
            self.buffers[index] = full
            self.views[index] = self.spec.segment(index).unflatten(full)
            self.refs[index] = 0
        self.refs[index] += 1
        return self.views[index]

    def release(self, index: int) -> None:
        self.refs[index] -= 1
        if self.refs[index] == 0:
            del self.views[index], self.refs[index]
            self.tracker.released(self.buffers.pop(index))

    def release_all(self) -> None:
        for index in list(self.refs):
            self.refs[index] = 1
            self.release(index)
