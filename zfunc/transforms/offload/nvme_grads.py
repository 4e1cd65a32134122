"""NVMe offload's gradients: each unit's in its swap file, written as its backward finishes
(``GradToDisk``).

A gradient's squared norm and inf/NaN check are taken while it is in memory, at its write, so the
step's one agreement on the norm reads nothing back from disk (``zfunc.swap.grad_stats``).
"""
from __future__ import annotations

import torch

from ... import dist, layout, swap
from ...ops import cpu_adam
from ...placement import optimizer_slices
from ...tree import Params
from ..sinks import GradOffHome


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

