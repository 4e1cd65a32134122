"""NVMe offload's gradients: each unit's in its swap file, written as its backward finishes
(``GradToDisk``), or, when a step accumulates, its fp32 sum kept there between micro-batches
(``FileSums``, the home offload_nvme hands the step's ``GradSink``: zfunc.transforms.sinks).

Either way a gradient's squared norm and inf/NaN check are taken while it is in memory, at its
write (the last write counts for a sum), so the step's one agreement on the norm reads nothing
back from disk (``zfunc.swap.grad_stats``).
"""
from __future__ import annotations

import torch

from ... import dist, layout, swap
from ...ops import cpu_adam
from ...placement import optimizer_slices
from ...tree import Params
from ..sinks import GradOffHome, SumHome


class GradToDisk(GradOffHome):
    """Each unit's gradient, reduced home, goes to its swap file the moment its reduction is done
    (or into the resident staging set); its norm and inf/NaN check are taken on the way."""

    def __init__(self, store: swap.SwapStore, spec):
        super().__init__(spec)
        self.store = store
        store.resident_grads = set()  # gradients this step put into the resident staging set
        self.written: set[int] = set()

    def _store(self, unit, g: torch.Tensor) -> None:
        i, store = unit.index, self.store
        placeholder = store.grads[i]
        stats = cpu_adam.nonfinite_and_sq_norm([g])
        data, offset = g, 0
        if optimizer_slices(unit.place, self.spec.sharded[i]):  # only this rank's slice is ever read
            r, w = dist.rank(unit.group), dist.world_size(unit.group)
            data = layout.shard(g, r, w)
            offset = data.storage_offset() * g.element_size()
        self.written.add(i)
        path = store.file_of(placeholder).path
        held = store.resident_buffer(path, offset, data.numel() * data.element_size())
        if held is not None:  # its sub-group is resident: the update reads it from there
            store.grad_stats[id(placeholder)] = stats
            store.dev.fetch(held, data)
            store.resident_grads.add(path)
            return
        store.write_gradient(data, placeholder, stats, offset)

    def finish(self) -> Params:
        self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
        return Params(self.spec, [self.store.grads[i] if i in self.written else None
                                  for i in range(len(self.spec.sharded))])


class FileSums(SumHome):
    """One step's sums under offload_nvme: each unit's lives in its fp32 gradient file between
    micro-batches: read, added to and written back, so RAM holds only the units in flight."""

    in_memory = False

    def __init__(self, store: swap.SwapStore):
        self.store = store
        self.on_file: set[int] = set()  # units whose sum so far is in their gradient file

    def start(self, unit, numel: int) -> torch.Tensor:
        acc = super().start(unit, numel)
        if unit.index in self.on_file:
            self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
            self.store.read_now(acc, self.store.file_of(self.store.grads[unit.index]))
        return acc

    def done(self, unit, acc: torch.Tensor, last: bool) -> None:
        """Write the sum so far out; the sink lets it go."""
        self.store.write_gradient(acc, self.store.grads[unit.index], cpu_adam.nonfinite_and_sq_norm([acc]))
        self.on_file.add(unit.index)

    def grads(self, sums: dict[int, torch.Tensor], n: int) -> list:
        self.store.wait(self.store.writer, "writing gradients", self.store.UNCHANGED)
        return [self.store.grads[i] if i in self.on_file else None for i in range(n)]
