"""Materializing units: gather in forward, send gradients home in backward.

``Materialize`` is one autograd Function per unit use: forward turns the
stored leaf (a shard, or the full buffer) into the full flat buffer and cuts it
into parameter views; backward writes the views' gradients into one new flat
buffer, already in the dtype the reduction runs in (so a bf16 unit reduced in
fp32 is cast in that same pass), and reduces it in place back to the leaf's
representation (reduce-scatter or all-reduce, mean over ranks) the moment
autograd is done with the unit.

Gathered buffers are never kept alive for backward: a saved-tensor hook
replaces any saved view of one with a small handle, and the unpack hook
re-gathers the unit (once per backward; released when the unit's own backward
runs).

Communication overlaps compute: the step's coordinator (zfunc.coordinator)
starts the reads and all-gathers of the units the recorded trace says come
next, within its budgets, and gradient reductions are started asynchronously
and waited for once backward is over. The root, and the unit forward released
last, stay gathered from forward into backward, which needs them first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import buffers, compiled, dist, layout, placement, swap
from .placement import Placement, grad_is_shard
from .tree import Params


class _Unit:
    """A unit's leaf plus what materializing it needs; lives for one forward/backward."""

    __slots__ = ("key", "name", "index", "leaf", "ready", "anchor", "place", "segment", "group", "gathers",
                 "tracker", "uses", "pending", "full", "full_numel", "device", "store", "stored", "second")

    def __init__(self, key, index, leaf, ready, place: Placement, segment, group, tracker, anchor=None, store=None,
                 stored=None, name: str = ""):
        self.key = key  # names the unit in the coordinator's trace: ("p" or "f", index)
        self.name = name  # for errors, and part of its collectives' identity (zfunc.dist.labelled)
        self.index = index
        self.leaf = leaf
        self.ready = ready  # returns once the leaf's values are complete (Params.leaf_when_ready)
        self.anchor = leaf if anchor is None else anchor
        self.place = place
        self.segment = segment
        self.group = group
        # a leaf in a swap file (zfunc.swap): its placeholder and store; it is read into a pool buffer
        self.store, self.stored = store, stored
        # materializing makes a new buffer (gathered, read in from disk, or copied from host memory)
        self.gathers = placement.gathers(place, group) or stored is not None or placement.copies_in(place)
        self.tracker = tracker
        self.uses = 0  # Materialize calls in this forward
        self.pending: dist.Pending | None = None  # a prefetched materialization
        self.full: torch.Tensor | None = None  # the full buffer of the latest Materialize
        self.full_numel = leaf.numel() * (dist.world_size(group) if placement.gathers(place, group) else 1)
        self.device = placement.compute_device(place, leaf, group)  # where compute sees the unit
        self.second: torch.Tensor | None = None  # hpZ: this rank's part of the unit over its secondary group

    def _start(self) -> dist.Pending:
        source = self.leaf if self.stored is None else self.stored
        with dist.labelled(self.name):
            if self.second is not None:  # after its forward (hpZ): gathered among the secondary group
                return dist.all_gather_start(self.second, dist.group_of(self.place.secondary))
            return placement.materialize_start(self.place, source, self.group, self.ready, self.store)

    def keep_secondary(self, full: torch.Tensor) -> None:
        """hpZ: forward is done with the unit's ``full`` buffer; keep this rank's part of it over the
        secondary group (``Placement.secondary``), which backward gathers the unit from."""
        if self.place.secondary is not None and self.second is None and self.gathers:
            group = dist.group_of(self.place.secondary)
            self.second = layout.shard(full, dist.rank(group), dist.world_size(group)).clone()
            self.tracker.hold_secondary(self.second.numel() * self.second.element_size())

    def wait(self, pending: dist.Pending) -> torch.Tensor:
        """``pending``'s buffer (an all-gather after a read from disk is issued only now)."""
        with dist.labelled(self.name):
            return pending.wait()

    def can_prefetch(self) -> bool:
        """Whether a read ahead leaves the swap pool a buffer for on-demand reads."""
        return self.store is None or self.store.pool.available() > 1

    def prefetch(self) -> None:
        if self.gathers and self.pending is None:
            self.pending = self._start()
            self.tracker.allocated(self.pending.out)

    def gather(self) -> torch.Tensor:
        """The full flat buffer: the prefetched one if any, else materialized now."""
        run = self.tracker.run if self.gathers else None  # a unit that gathers nothing is not traced
        if run is not None:
            run.using(self)  # counts a hit or a miss, and prefetches what comes next
        self.prefetch()
        if self.pending is None:
            return self.wait(self._start())
        pending, self.pending = self.pending, None
        if run is None:
            return self.wait(pending)
        with run.waiting():
            return self.wait(pending)

    def give(self, buf: torch.Tensor) -> None:
        """Hand back a buffer materializing made: to the swap pool if it came from there."""
        if self.store is None or not self.store.give(buf):
            buffers.give(buf)

    def grad_dtype(self) -> torch.dtype:
        """The full gradient's dtype: the reduction's, unless nothing is reduced (W = 1)."""
        if self.tracker.sink is None and dist.world_size(self.group) == 1:
            return self.leaf.dtype
        return self.place.reduce_dtype or self.leaf.dtype

    def send_home_start(self, grad_full: torch.Tensor, out_dtype: torch.dtype | None = None, *,
                        final: bool = True) -> dist.Pending:
        """Start reducing this unit's full gradient (given up) to its home form: an event of the
        coordinator's pass first, so the ranks' reductions are kept in step as their gathers are.
        ``final``: the step's last reduction of it (``placement.send_home_start``)."""
        if self.tracker.run is not None and dist.world_size(self.group) > 1:
            self.tracker.run.sending_home(self)
        with dist.labelled(self.name):
            return placement.send_home_start(self.place, grad_full, self.group, out_dtype=out_dtype, final=final)

    def reduce(self, grad_full: torch.Tensor) -> torch.Tensor | None:
        # grad_full is ours (Materialize's backward made it): it is reduced in place
        if self.tracker.sink is not None:  # accumulating: the sink takes it, autograd gets None
            self.tracker.sink.take(self, grad_full)
            return None
        pending = self.send_home_start(grad_full, out_dtype=self.anchor.dtype)
        if pending.done:
            return pending.out
        if self.uses > 1:  # autograd will add this gradient to another: it must be final now
            return pending.wait()
        self.tracker.reducing(pending)
        return pending.out


class Materialize(torch.autograd.Function):
    """A unit's stored form to one view per parameter (``Segment.unflatten`` of the full buffer).

    ``anchor`` is what autograd differentiates: the leaf itself, or for a full
    leaf with sharded gradients (stage 2) a shard-shaped stand-in, since a
    gradient must have its input's shape. The full buffer is left in
    ``unit.full`` for the caller. Backward writes the gradients into one new
    flat buffer (zeros where a parameter got none, and in the padding) that
    the reduction owns and reduces in place; autograd's own backward of
    ``split`` would give a buffer it might share, in the parameters' dtype.
    A gradient accumulator that sums whole gradients (zfunc.transforms.accumulate) takes
    the views' gradients directly instead.
    """

    @staticmethod
    def forward(anchor: torch.Tensor, unit: _Unit) -> tuple[torch.Tensor, ...]:
        full = unit.gather()
        unit.full = full
        return tuple(unit.segment.unflatten(full).values())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.unit = inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        unit: _Unit = ctx.unit
        unit.tracker.release_backward(unit)
        unit.tracker.got_gradients(unit, grads)
        sink = unit.tracker.sink
        if sink is not None and sink.takes_parts(unit):  # accumulating a whole gradient: no flat copy
            sink.take_parts(unit, grads)
            return None, None
        flat = buffers.take(unit.full_numel, unit.grad_dtype(), unit.device)
        offset = 0
        for entry, g in zip(unit.segment.entries, grads):
            flat[offset : entry.offset].zero_()  # a gap of an owner layout (zfunc.tree._segment)
            dst = flat[entry.offset : entry.offset + entry.numel]
            if g is None:
                dst.zero_()
            else:
                dst.view(entry.shape).copy_(g)
            offset = entry.offset + entry.numel
        flat[offset:].zero_()
        return unit.reduce(flat), None


@dataclass
class _SavedView:
    """Stands in for a saved view of a gathered buffer until backward needs it."""

    unit: _Unit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class Tracker:
    """Gathered buffers of one forward/backward: which are live, prefetches, peak bytes."""

    def __init__(self):
        self.live: dict[int, _Unit] = {}  # storage ptr of a gathered buffer -> its unit
        self.starts: dict[_Unit, int] = {}  # unit -> where its latest buffer starts in its storage
        self.backward_cache: dict[_Unit, torch.Tensor] = {}  # unit -> buffer for backward
        self.backward_started: set[_Unit] = set()  # units backward has asked for
        self.reductions: list[dist.Pending] = []
        self.units: list[_Unit] = []
        self.by_name: dict[str, _Unit] = {}  # canonical parameter name -> its unit
        self.current = 0
        self.peak = 0
        self.sink = None  # a grad sink (zfunc.transforms.sinks) while accumulating or offloading
        self.run = None  # the coordinator's pass (zfunc.coordinator.Run), if prefetching
        self.prefetch: tuple = ()  # its metrics, once the pass completed
        self.got: dict[int, tuple[bool, ...]] = {}  # unit -> which of its parameters got a gradient

    def got_gradients(self, unit: _Unit, grads) -> None:
        """Note which of ``unit``'s parameters got a gradient in this backward (``None``: none,
        as torch leaves ``.grad`` None), over all its uses; the zeros written for the others are
        no gradient to the optimizer (``GradOut.live``)."""
        got = tuple(g is not None for g in grads)
        seen = self.got.get(unit.index)
        self.got[unit.index] = got if seen is None else tuple(a or b for a, b in zip(seen, got))

    def allocated(self, buf: torch.Tensor) -> None:
        self.current += buf.numel() * buf.element_size()
        self.peak = max(self.peak, self.current)
        if self.run is not None:
            self.run.allocated(buf.numel())

    def hold_secondary(self, nbytes: int) -> None:
        """hpZ's secondary parts, kept from a unit's forward to its backward, count in the peak of
        what is materialized (``metrics["peak_materialized_bytes"]``); negative: let go."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def freed(self, buf: torch.Tensor) -> None:
        self.current -= buf.numel() * buf.element_size()
        if self.run is not None:
            self.run.freed(buf.numel())

    def holds(self, unit: _Unit) -> bool:
        """Whether ``unit`` has a gathered buffer alive now."""
        return unit in self.backward_cache or any(u is unit for u in self.live.values())

    def gathered(self, unit: _Unit, buf: torch.Tensor) -> None:
        if unit.gathers:
            self.live[buf.untyped_storage().data_ptr()] = unit
            self.starts[unit] = buf.storage_offset()

    def _give_back(self, unit: _Unit, buf: torch.Tensor) -> None:
        """Done with ``unit``'s gathered ``buf``: kept for its next use if the coordinator's trace
        has it within the reuse distance (still counted as live), else freed."""
        if self.run is not None and unit.pending is None and self.run.keeps(unit):
            unit.pending = dist.Pending(buf)
            return
        self.freed(buf)
        unit.give(buf)

    def released(self, unit: _Unit, buf: torch.Tensor) -> None:
        if self.live.pop(buf.untyped_storage().data_ptr(), None) is not None:
            self._give_back(unit, buf)

    def keep_for_backward(self, unit: _Unit, buf: torch.Tensor) -> None:
        """Forward is done with ``buf`` but backward will want it: keep it instead of re-gathering
        (unless backward already re-gathered it, for an activation checkpoint)."""
        if self.live.pop(buf.untyped_storage().data_ptr(), None) is None:
            return
        if unit in self.backward_cache:
            self._give_back(unit, buf)
        else:
            self.backward_cache[unit] = buf

    def drop_kept(self, unit: _Unit) -> None:
        """Backward will not get ``unit``'s kept buffer after all: give it back."""
        buf = self.backward_cache.pop(unit, None)
        if buf is not None:
            self._give_back(unit, buf)

    @compiled.eager
    def pack(self, t: torch.Tensor):
        # a tensor saved as it is (not detached) holds its own node when the node saved its output:
        # a cycle through autograd that the garbage collector cannot see, so a graph never
        # differentiated (the engine's forward whose output is dropped) would never be freed
        if not self.live or t.layout != torch.strided:
            return t.detach()
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t.detach()
        unit = self.live.get(ptr)
        if unit is None:
            return t.detach()
        # the offset within the unit's buffer: a re-materialized one may start elsewhere in its
        # storage (a swap pool buffer is aligned inside a larger allocation)
        return _SavedView(unit, t.size(), t.stride(), t.storage_offset() - self.starts[unit])

    @compiled.eager
    def unpack(self, saved):
        if not isinstance(saved, _SavedView):
            return saved
        buf = self._backward_buffer(saved.unit)
        return buf.as_strided(saved.size, saved.stride, buf.storage_offset() + saved.offset)

    @compiled.eager
    def resolve(self, name: str) -> torch.Tensor:
        """A parameter read during backward (an activation checkpoint recomputing its
        forward): its value from the unit, re-gathered as for saved tensors."""
        unit = self.by_name[name]
        value = unit.segment.unflatten(self._backward_buffer(unit))[name].detach()
        # as in forward, so the recomputation saves the same tensors (its graph is discarded)
        return value.requires_grad_(unit.anchor.requires_grad)

    def _backward_buffer(self, unit: _Unit) -> torch.Tensor:
        buf = self.backward_cache.get(unit)
        if buf is None:
            with torch.no_grad():
                buf = unit.gather()
            self.backward_cache[unit] = buf
        self.backward_started.add(unit)
        return buf

    def release_backward(self, unit: _Unit) -> None:
        if unit.second is not None:  # its backward is done: a later use (a unit run twice) gathers anew
            self.hold_secondary(-unit.second.numel() * unit.second.element_size())
            unit.second = None
        buf = self.backward_cache.pop(unit, None)
        if buf is not None:
            if unit.gathers:
                self._give_back(unit, buf)
            else:
                self.freed(buf)

    def reducing(self, pending: dist.Pending) -> None:
        """Track a reduction in flight; at most two, so gradients do not pile up."""
        if len(self.reductions) >= 2:
            self.reductions.pop(0).wait()
        self.reductions.append(pending)

    def finish(self) -> None:
        """Wait for the gradient reductions still in flight."""
        while self.reductions:
            self.reductions.pop(0).wait()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def close(self, abandon: bool = False) -> None:
        """Drop everything; wait for prefetches no one used (every rank issued them), unless
        ``abandon``: after a failed collective, waiting on the others would only fail again."""
        if abandon:
            self.reductions.clear()
        self.finish()
        for unit in self.units:
            if unit.pending is not None:
                pending, unit.pending = unit.pending, None
                if not abandon:
                    unit.give(unit.wait(pending))
        for unit, buf in self.backward_cache.items():
            if unit.gathers:
                unit.give(buf)
        self.backward_cache.clear()
        self.live.clear()
        self.current = 0
        # the units point back here: without these references the step's buffers and the
        # sink's sums go as soon as the caller drops them, not at the next garbage collection
        # (the coordinator's pass holds the units too)
        self.units, self.by_name, self.sink, self.run = [], {}, None, None
        self.starts.clear()
        self.backward_started.clear()


class Materializer:
    """Materializes the units of a ``Params`` node on demand, with reference counts.

    With ``differentiable``, each unit gets an autograd anchor (``anchors``)
    whose gradient is the unit's gradient in its home representation.
    """

    def __init__(self, params: Params, tracker: Tracker, differentiable: bool = False, kind: str = "p"):
        spec = params.spec
        self.spec = spec
        self.tracker = tracker
        group = spec.process_group
        w = dist.world_size(group)
        store = swap.store_of(spec.swap)
        self.units = []
        for i, (sharded, place, info) in enumerate(zip(spec.sharded, spec.placements, spec.model.units)):
            leaf, ready = params.leaf_when_ready(i)
            stored = leaf if swap.on_disk(leaf) else None
            leaf = leaf.detach()
            anchor = None
            if differentiable and grad_is_shard(place, sharded) and not sharded and w > 1:
                # a gradient has its input's shape: a shard-shaped stand-in for a full leaf
                anchor = torch.empty_strided((layout.shard_numel(leaf.numel(), w),), (0,), dtype=leaf.dtype,
                                             device=leaf.device)
                anchor.requires_grad_()
            elif differentiable:
                leaf.requires_grad_()
            name = ("frozen " if kind == "f" else "") + (info.name or "<root>")
            self.units.append(_Unit((kind, i), i, leaf, ready, place, spec.segment(i), group, tracker, anchor,
                                    store if stored is not None else None, stored, name))
            for entry in spec.segment(i).entries:
                tracker.by_name[entry.name] = self.units[-1]
        self.anchors = [u.anchor for u in self.units]
        tracker.units.extend(self.units)
        if tracker.run is not None:
            for unit in self.units:
                if unit.leaf.numel():
                    tracker.run.register(unit, unit.name)
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.refs: dict[int, int] = {}
        # the root unit (embeddings, the head) stays gathered from forward into backward,
        # which needs it first: one all-gather fewer a step (FSDP2 keeps its root the same way)
        self.root = next((i for i, u in enumerate(spec.model.units) if u.name == ""), None)
        # so does the unit forward released last, until forward gathers another: when forward
        # ends, that is the block backward needs next, and it is not gathered twice
        self.differentiable = differentiable
        self.last: _Unit | None = None

    def acquire(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self.views:
            unit = self.units[index]
            segment = self.spec.segment(index)
            if unit.leaf.numel() == 0:
                full, views = unit.leaf, segment.unflatten(unit.leaf)
            else:
                self._drop_last()
                unit.uses += 1
                views = dict(zip((e.name for e in segment.entries), Materialize.apply(unit.anchor, unit)))
                full, unit.full = unit.full, None
                self.tracker.gathered(unit, full)
            self.buffers[index] = full
            self.views[index] = views
            self.refs[index] = 0
        self.refs[index] += 1
        return self.views[index]

    def release(self, index: int) -> None:
        self.refs[index] -= 1
        if self.refs[index] == 0:
            del self.views[index], self.refs[index]
            buf, unit = self.buffers.pop(index), self.units[index]
            in_forward = self.differentiable and torch.is_grad_enabled() and not self.tracker.backward_started
            if in_forward and (index == self.root or unit.gathers):
                if index != self.root:
                    unit.keep_secondary(buf)
                    self._drop_last()
                    self.last = unit
                self.tracker.keep_for_backward(unit, buf)
            else:
                self.tracker.released(unit, buf)

    def _drop_last(self) -> None:
        if self.last is not None:
            self.tracker.drop_kept(self.last)
            self.last = None
