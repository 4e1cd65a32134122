"""NVMe offload as a step transform: parameters, gradients and optimizer state in swap files
(ZeRO-Infinity).

``offload_nvme(step, path)`` keeps, per unit, this rank's parameter shard (and
its frozen parameters' shard), its gradient and every optimizer-state tensor
(fp32 master, Adam's moments) in swap files under ``path/rank{r}/``
(zfunc.swap). RAM holds a fixed pool of ``buffer_count`` read buffers of at
most ``buffer_size`` elements, the units in use, and the update's three
staging sets of at most ``min(sub_group_size, buffer_size)`` elements of each
tensor, whatever the model's size and however large a unit.

* init: each unit's shard is staged to disk as it is made (its frozen shard is
  written there once, in its stored dtype: nothing updates it); the optimizer
  state is then built one unit at a time, a piece of at most the staging size
  at a time, and written out, so init never holds more than a unit either.
* forward and backward: a unit is read into a pool buffer ahead of use (the
  step's coordinator, zfunc.coordinator, issues the reads, then the
  all-gathers, along the order recorded in the first step), gathered if sharded, and its buffer returned after use; backward
  re-reads it. A unit larger than a pool buffer is read into a buffer of its
  own, which compute uses and drops (on a GPU it passes through the pool
  buffers a part at a time instead: zfunc.swap). Its gradient, once reduced, is written to its swap file at
  once (``GradToDisk``), with its squared norm and inf/NaN check taken while
  it is in memory, so the step's one agreement on the norm reads nothing back.
* update: units are streamed in sub-groups of at most ``min(sub_group_size,
  buffer_size)`` elements, a larger unit cut into pieces of that size (Adam is
  elementwise, as it is over a shard): the next sub-group's master, moments
  and gradient are read while the current one is updated by the inner
  optimizer (the fused CPU Adam), and the one before is written back. The
  optimizer sees one sub-group at a time, other units stand in as empty
  tensors with no gradient; its step count, and each unit's, advances once per
  step. Clipping folds into the step's ``GradInfo``, so it still sees the global norm.
  DeepSpeed's default ``sub_group_size=1e9`` would hold a 1B-parameter part's
  whole state in RAM, more than offload_cpu; ``buffer_size`` caps it.
* the last sub-group stays in its staging set (``SwapStore.resident``): its
  writes finish behind the step, the next forward reads its units from RAM,
  backward puts its gradients there instead of on disk, and the next update
  starts with it (so the order runs back and forth, step after step). A model
  whose part fits in one sub-group thus reads nothing back from disk: its
  state is written through to the swap files each step. A write that fails
  behind the step is raised by the next use of the state.

On a GPU (nccl) the disk and the optimizer stay on the host: a unit read into a pinned
pool buffer is uploaded to the group's device and gathered there, each gradient
comes back into a pinned staging buffer of a pool buffer's size, a part at a
time, before it is written, and the update runs on host tensors (zfunc.swap's
``Device`` holds the copies and their events). Host memory there is the pool,
the two staging buffers and the update's three sets, whatever the unit sizes.

Write it inside the ZeRO stage and outside ``mixed_precision``:
``zero3(offload_nvme(mixed_precision(f), path))``. ``params=True`` needs zero3
(or no stage at all): zero1/2 keep full parameters on every rank. Under
``accumulate`` the gradient files hold the fp32 sums between micro-batches
(zfunc.transforms.sinks's ``GradSink``).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from typing import Any

import optree
import torch

from ... import dist, layout, swap
from ...buffers import trim as trim_heap
from ...coordinator import prefetch_settings
from ...grad import grad_spec
from .plan import (OffloadPlan, as_plan, check_host_memory, disk_roofline, host_state_bytes, once_per_spec,
    plan_for_host_budget, rank_units, whole)
from .rates import cached_disk
from ...ops import cpu_adam
from ...ops.aio import aligned_empty
from ...optim.base import GradInfo, Optimizer, apply_update, state_bytes_per_element
from ...optim.counts import is_count
from ...placement import CPU, DEVICE, NVME, Placement, grad_is_shard, optimizer_slices
from ...pytree import NAMESPACE, register_node
from ..sinks import GradOffHome, with_grad_sink
from ...state import master_weights
from ...step import Step, expect_step
from ...transform import Transform, check_inside_zero
from ...tree import Params


class SwapState:
    """The optimizer state under NVMe offload: the inner state, whose per-unit tensors are
    placeholders of swap files, and the store that owns the files (static data)."""

    __slots__ = ("store", "inner")
    _fields = ("inner",)  # its one child: the inner optimizer's state (zfunc.state.wrapper_role)

    def __init__(self, store: swap.SwapStore, inner: Any):
        self.store, self.inner = store, inner

    def __repr__(self) -> str:
        return f"SwapState({self.store.dir!r}, {self.inner!r})"


register_node(SwapState, lambda s: ((s.inner,), s.store), lambda store, children: SwapState(store, children[0]))

_KINDS = {"mu": "exp_avg", "nu": "exp_avg_sq", "master": "master", "momentum": "momentum"}


def _is_params(x) -> bool:
    return isinstance(x, Params)


def _flatten(tree):
    """``(nodes, treedef)``: the leaves of ``tree`` with each ``Params`` node kept whole."""
    return optree.tree_flatten(tree, is_leaf=_is_params, namespace=NAMESPACE)


def _kinds(tree) -> dict[int, str]:
    """For each Params node of an optimizer state (by position), a file-name kind."""
    accessors, _, _ = optree.tree_flatten_with_accessor(tree, is_leaf=_is_params, namespace=NAMESPACE)
    nodes = _flatten(tree)[0]
    out, seen = {}, set()
    for k, (acc, node) in enumerate(zip(accessors, nodes)):
        if not isinstance(node, Params):
            continue
        names = [n for n in (getattr(e, "field", e.entry) for e in acc) if isinstance(n, str)]
        kind = _KINDS.get(names[-1], names[-1]) if names else f"state{k}"
        if kind in seen:
            kind = f"{kind}{k}"
        seen.add(kind)
        out[k] = kind
    return out


def _empty(like: torch.Tensor) -> torch.Tensor:
    """What a unit outside the sub-group looks like to the optimizer: no elements."""
    return torch.empty(0, dtype=like.dtype)


def _sub_groups(units: list[int], sizes: dict[int, int], limit: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive pieces ``(unit, start, stop)`` of units in groups of at most ``limit`` elements: a
    unit larger than ``limit`` is cut into pieces of ``limit`` (the update is elementwise, as it is
    over a shard), so no group, and no staging set, ever holds more."""
    groups, current, n = [], [], 0
    for i in units:
        for a, b in swap.parts(sizes[i], limit):
            if current and n + b - a > limit:
                groups.append(current)
                current, n = [], 0
            current.append((i, a, b))
            n += b - a
    if current:
        groups.append(current)
    return groups


def piece_size(sub_group_size: int, buffer_size: int) -> int:
    """Elements the update (and init) holds of each state tensor at once: ``sub_group_size``, at most
    ``buffer_size``; whole 4 KiB pages of any dtype where it is that large, so pieces start where
    direct I/O can."""
    n = min(sub_group_size, buffer_size)
    return n - n % 4096 if n >= 4096 else n


# ---------------------------------------------------------------- the update


def swapped_optimizer(optimizer: Optimizer, piece: int, record: dict | None = None) -> Optimizer:
    """``optimizer`` over state held in swap files, run one sub-group of at most ``piece`` elements
    at a time (``piece_size``); init makes a unit's state ``piece`` elements at a time too.
    ``record`` (if given) gets the update's start and end, for the step's roofline."""

    def init(params: Params):
        store = swap.store_of(params.spec.swap)
        leaves = params.leaves
        merged, specs, treedef, kinds = None, None, None, None  # leaves per node, gathered unit by unit
        for i, leaf in enumerate(leaves):
            # the state is made on the host, a piece at a time where it goes to disk (whole where it stays in RAM)
            step = piece if params.spec.placements[i].opt_home == NVME else max(1, leaf.numel())
            staged = store.is_staged(leaf)
            pieces = (store.take_staged(leaf, step) if staged
                      else ((a, leaf[a:b].cpu()) for a, b in swap.parts(leaf.numel(), step)))
            for start, values in pieces:
                one = Params(params.spec, [values if j == i else _empty(x) for j, x in enumerate(leaves)])
                nodes, treedef = _flatten(optimizer.init(one))
                if merged is None:
                    merged = [list(n.leaves) if isinstance(n, Params) else n for n in nodes]
                    specs = [n.spec if isinstance(n, Params) else None for n in nodes]
                    kinds = _kinds(treedef.unflatten(nodes))
                for k, node in enumerate(nodes):
                    if isinstance(node, Params):
                        merged[k][i] = _keep_state(store, params, i, kinds[k], node.leaves[i], merged[k][i], start)
                if staged:
                    store.write_now(values.to(leaf.dtype), leaf, start * leaf.element_size())
                del one, nodes, values
            trim_heap()  # this unit's temporaries go back to the OS before the next unit's
        nodes = [Params(spec, merged[k]) if spec is not None else merged[k] for k, spec in enumerate(specs)]
        return SwapState(store, treedef.unflatten(nodes))

    def update(grads: Params, opt_state: SwapState, params: Params, *, info: GradInfo | None = None,
               lowp_params=None):
        if lowp_params is not None:
            raise ValueError("offload_nvme goes outside mixed_precision: zeroN(offload_nvme(mixed_precision(f)))")
        started = time.perf_counter()
        out = _Update(optimizer, grads, opt_state, params, info, piece).run()
        if record is not None:
            record.update(started=started, ended=time.perf_counter())
        return out

    return Optimizer(init, update, fuses=True)


def _keep_state(store: swap.SwapStore, params: Params, i: int, kind: str, t: torch.Tensor, kept, start: int):
    """Unit ``i``'s state tensor ``t`` as init made it for the piece at element ``start``: where the
    state lives on disk, written into its swap file (made at the first piece) and that file's
    placeholder returned; else ``t`` itself (a per-unit counter: the first piece's)."""
    if params.spec.placements[i].opt_home == NVME and t.dim() == 1 and t.numel() and not is_count(t):
        if start == 0:
            kept = store.create(i, params.spec.model.units[i].name, kind, params.leaves[i].numel(), t.dtype,
                                store.offsets[i])
        store.write_now(t, kept, start * t.element_size())
        return kept
    return t if start == 0 else kept


def _held(bufs: dict, key, in_memory):
    """A piece's tensor: its staging buffer if it came from disk, else ``in_memory()`` (a view)."""
    return bufs[key] if key in bufs else in_memory()


class _Update:
    """One streamed update: sub-group k computes while k+1 is read and k-1 written. A sub-group is a
    list of pieces ``(unit, start, stop)``: elements ``start:stop`` of the unit's parameters,
    gradient and state tensors."""

    SLOTS = 3

    def __init__(self, optimizer, grads: Params, opt_state: SwapState, params: Params, info, piece: int):
        self.optimizer, self.info = optimizer, info
        self.store = opt_state.store
        self.store.check_usable()
        self.params, self.grads = params, grads
        self.p, self.g = list(params.leaves), list(grads.leaves)
        self.nodes, self.treedef = _flatten(opt_state.inner)
        self.pnodes = [k for k, n in enumerate(self.nodes) if isinstance(n, Params)]
        self.final = {k: list(self.nodes[k].leaves) for k in self.pnodes}
        self.read_params = master_weights(opt_state.inner) is None  # else parameters are only written
        live = [i for i, g in enumerate(self.g) if g is not None and self.p[i].numel()]
        self.groups = _sub_groups(live, {i: self.p[i].numel() for i in live}, piece)

    # which tensors of a piece come from disk: (role, key, placeholder view, read?)
    def _disk_tensors(self, piece):
        i, a, b = piece
        out = []
        if swap.on_disk(self.p[i]):
            out.append(("p", None, self.p[i][a:b], self.read_params))
        if swap.on_disk(self.g[i]):
            out.append(("g", None, self.g[i][a:b], True))
        for k in self.pnodes:
            t = self.nodes[k].leaves[i]
            if swap.on_disk(t):
                out.append(("o", k, t[a:b], True))
        return out

    def _plan(self, group) -> tuple[list, list[int]]:
        """``group``'s tensors from disk, (piece, role, key, placeholder view, read?), and their aligned
        sizes in a staging set."""
        plan = [(piece, *x) for piece in group for x in self._disk_tensors(piece)]
        return plan, [swap.aligned(t.numel() * t.element_size()) for *_, t, _ in plan]

    def _read(self, group, slot: int, handle, held=frozenset()):
        """Queue the reads of ``group`` into staging arena ``slot``; the buffers by (role, key, piece).
        Files in ``held`` already have their values there (the resident sub-group): not read."""
        plan, sizes = self._plan(group)
        arena = self._arena(slot, sum(sizes))
        bufs, off = {}, 0
        for (piece, role, key, t, read), size in zip(plan, sizes):
            buf = arena[off : off + t.numel() * t.element_size()].view(t.dtype)
            off += size
            _, file, base = swap.locate(t)
            if read and file.path not in held:
                self.store._io(f"reading '{file.path}'", lambda: handle.pread(buf, file.path, base))
                self.store.bytes_read += buf.numel() * buf.element_size()
            bufs[role, key, piece] = buf
        return bufs

    def _arena(self, slot: int, nbytes: int) -> torch.Tensor:
        """Staging set ``slot``, made at once as large as the largest sub-group needs: one that grew
        step by step would leave each smaller one behind in a pinned-memory cache (CUDA's)."""
        arenas = self.store.arenas
        while len(arenas) <= slot:
            arenas.append(torch.empty(0, dtype=torch.uint8))
        if arenas[slot].numel() < nbytes:
            arenas[slot] = torch.empty(0, dtype=torch.uint8)  # drop the old one first
            arenas[slot] = aligned_empty(max([nbytes, *(sum(self._plan(g)[1]) for g in self.groups)]))
        return arenas[slot]

    def _compute(self, group, bufs):
        """The inner optimizer over ``group``'s pieces; the other units are empty and have no gradient.
        Returns what it was handed and what it returned, (parameters, state nodes) each."""
        at = {i: (i, a, b) for i, a, b in group}
        starts = {i: a for i, a, _ in group}  # where each piece lies in its unit's leaf: its parameters' ranges
        p, g = [], []
        for i, (leaf, grad) in enumerate(zip(self.p, self.g)):
            piece = at.get(i)
            if piece is None:
                p.append(_empty(leaf))
                g.append(None)
                continue
            _, a, b = piece
            p.append(_held(bufs, ("p", None, piece), lambda: leaf[a:b].cpu()))  # a leaf on the device: a host copy
            g.append(_held(bufs, ("g", None, piece), lambda: grad[a:b]))
        nodes = list(self.nodes)
        for k in self.pnodes:
            leaves = []
            for i, t in enumerate(self.nodes[k].leaves):
                piece = at.get(i)
                if piece is None:
                    leaves.append(_empty(t) if t.dim() else t)
                elif is_count(t):  # step counts (per unit or per parameter): each piece advances a copy of
                    leaves.append(t.clone())  # the unit's counts as they were before the update
                else:
                    leaves.append(_held(bufs, ("o", k, piece), lambda: t[piece[1]:piece[2]]))
            nodes[k] = Params(self.nodes[k].spec, leaves, starts=starts)  # the master weights, under mixed precision
        info = None if self.info is None else replace(self.info)  # each group folds anew
        new_p, new_state = apply_update(self.optimizer, Params(self.grads.spec, g), self.treedef.unflatten(nodes),
                                        Params(self.params.spec, p, starts=starts), info=info)
        return (p, nodes), (new_p.leaves, _flatten(new_state)[0])

    def _write_back(self, group, bufs, handed, returned, handle) -> None:
        (p_in, nodes_in), (new_p, new_nodes) = handed, returned
        for piece in group:
            i, a, b = piece
            if swap.on_disk(self.p[i]):
                self._write(handle, bufs, ("p", None, piece), new_p[i], self.p[i][a:b])
            elif new_p[i] is not p_in[i]:
                self.p[i][a:b].copy_(new_p[i])  # into the device's copy: a blocking upload
            for k in self.pnodes:
                old, new = self.nodes[k].leaves[i], new_nodes[k].leaves[i]
                if swap.on_disk(old):
                    self._write(handle, bufs, ("o", k, piece), new, old[a:b])
                elif not is_count(old):
                    if new is not nodes_in[k].leaves[i]:
                        old[a:b].copy_(new)
                else:
                    self.final[k][i] = new  # step counts: every piece advanced the same copy's worth

    def _write(self, handle, bufs, key, new, placeholder) -> None:
        buf = bufs.get(key)
        if buf is not None and new is not buf:  # an optimizer that returned new tensors: keep the set current
            buf.copy_(new)
            new = buf
        self.store.write(handle, new, placeholder)

    def _order(self) -> tuple[list, int, frozenset]:
        """The sub-groups in the order to update them, the first one's staging slot, and the files
        whose values that slot already holds: the sub-group left resident by the last update goes
        first (so the order runs back and forth, step after step), with the gradients written into
        it during backward. If the groups changed (a unit got no gradient), it is given up."""
        store, groups = self.store, list(self.groups)
        res = store.resident
        if res is None or not groups:
            return groups, 0, frozenset()
        if set(groups[0]) != res.pieces and set(groups[-1]) == res.pieces:
            groups.reverse()
        if set(groups[0]) == res.pieces:
            held = {path for path, (key, _, _) in res.files.items() if key[0] != "g" or path in store.resident_grads}
            return groups, res.slot, frozenset(held)
        store.drop_resident()
        return groups, 0, frozenset()

    def run(self):
        """Read ahead, write behind: sub-group n is updated while n+1 is read and n-1 written. The last
        one stays in its staging set, its writes still in flight when the step returns."""
        store = self.store
        store.settle()  # the last update's resident writes (long done; a failure surfaces here)
        store.quiesce()  # uploads out of the resident set: done before anything writes into it
        groups, first, held = self._order()
        reader, writer = store._handle(), store._handle()
        new_nodes, wrote = None, False
        try:
            if not groups:  # no unit has a gradient: only the step count moves
                _, (_, new_nodes) = self._compute([], {})
            else:
                bufs = self._read(groups[0], first, reader, held)
                store.wait(reader, "reading the optimizer state")
                for n, group in enumerate(groups):
                    last = n + 1 == len(groups)
                    ahead = None if last else self._read(groups[n + 1], (first + n + 1) % self.SLOTS, reader)
                    handed, returned = self._compute(group, bufs)
                    new_nodes = returned[1]
                    store.wait(writer, "writing the optimizer state")
                    wrote = True
                    handle = store._handle() if last else writer
                    store.faults.fire("update", handle)
                    self._write_back(group, bufs, handed, returned, handle)
                    if last:
                        store.keep_resident((first + n) % self.SLOTS, group, bufs, handle, self._files(group))
                    store.wait(reader, "reading the optimizer state")
                    bufs = ahead
                store.wait(writer, "writing the optimizer state")
        except BaseException as e:
            for h in (reader, writer):  # nothing may still touch the staging sets; the first error is raised
                with contextlib.suppress(OSError, EOFError):
                    h.wait()
            store.drop_resident(quiet=True)
            if wrote:
                store.fail(f"the update of step failed after writing part of the state ({e})")
            raise
        finally:
            store._idle += [reader, writer]
        nodes = list(new_nodes)
        for k in self.pnodes:
            nodes[k] = Params(self.nodes[k].spec, self.final[k])
        return Params(self.params.spec, self.p), SwapState(store, self.treedef.unflatten(nodes))

    def _files(self, group) -> dict:
        """file -> ((role, key, piece), byte offset, bytes) of the buffers of ``group``'s staging set."""
        out = {}
        for piece in group:
            for role, key, t, _ in self._disk_tensors(piece):
                _, file, base = swap.locate(t)
                out[file.path] = ((role, key, piece), base, t.numel() * t.element_size())
        return out


# ---------------------------------------------------------------- gradients


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


# ---------------------------------------------------------------- the transform


class OffloadNvme(Transform):
    family = "offload"

    def __init__(self, path, params: bool, optimizer: bool, buffer_count: int, buffer_size: int,
                 sub_group_size: int, aio: dict | None, prefetch=None, faults: swap.Faults | None = None,
                 plan: OffloadPlan | None = None, host_budget: int | None = None):
        self.prefetch = prefetch  # the coordinator's settings, if given here
        self.plan, self.host_budget = plan, host_budget  # which units' optimizer state stays in host memory
        self._kept: dict = {}  # id(ModelSpec) -> (spec, the plan made for it)
        self.faults = faults  # disk errors armed by a test (swap.Faults), or None
        self.path, self.params, self.optimizer = path, params, optimizer
        self.buffer_count, self.buffer_size = buffer_count, buffer_size
        self.piece = piece_size(sub_group_size, buffer_size)  # elements of each state tensor the update holds at once
        self.aio = aio
        self._record: dict = {}  # the last update's start and end (swapped_optimizer), for the roofline
        self._disk = None  # (the disk's measured (read, write) rates or None), read from the cache once

    @property
    def name(self) -> str:
        return "offload_nvme"

    def describe(self, inner: str) -> str:
        what = [k for k, on in (("params", self.params), ("optimizer", self.optimizer)) if not on]
        return f"offload_nvme({inner}" + "".join(f", {k}=False" for k in what) + ")"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(offload_nvme(f, path))")

    def place(self, p: Placement, unit) -> Placement:
        return replace(p, grad_home=NVME, opt_home=NVME if self.optimizer else CPU,
                       param_home=NVME if self.params else p.param_home)

    def place_in(self, p: Placement, unit, spec, step) -> Placement:
        placed = self.place(p, unit)
        plan = self.plan_for(spec, step)
        if plan is not None and unit.name in plan.host_units:
            return replace(placed, opt_home=CPU)  # its optimizer state (and master) in host memory
        return placed

    def plan_for(self, spec, step) -> OffloadPlan | None:
        """The split of ``spec``'s units' optimizer state between host memory and disk
        (``make_host_plan``), made once per model spec."""
        if self.plan is None and self.host_budget is None:
            return None
        return once_per_spec(self._kept, spec, lambda: make_host_plan(spec, step, self, self.plan, self.host_budget))

    def wrap_optimizer(self, optimizer):
        return swapped_optimizer(optimizer, self.piece, self._record)

    def wrap_grad(self, grad_fn):
        return with_grad_sink(grad_fn, lambda params: GradToDisk(swap.store_of(params.spec.swap),
                                                                 grad_spec(params.spec)))

    def params_off_device_error(self, stage: int) -> str | None:
        if not self.params:
            return None
        return (f"zero{stage} keeps the full parameters on every rank, so they cannot live on NVMe: "
                f"write zero{stage}(offload_nvme(f, path, params=False)) to offload gradients and "
                "optimizer state, or zero3(offload_nvme(f, path)) to offload parameter shards too")

    def check_state(self, state) -> None:
        swap.check_state(state)

    def begin_step(self, state):
        self._record.clear()
        counts = swap.io_counts(state)
        return None if counts is None else (counts, time.perf_counter())

    def step_metrics(self, state, begun) -> dict:
        """``nvme``: this step's disk traffic (bytes) and the pool's use; ``offload``: its roofline
        against the disk's rates, where ``zfunc.transforms.offload.rates.measure_disk`` has measured them."""
        if begun is None:
            return {}
        begun, t0 = begun
        after = swap.io_counts(state)
        out = {"nvme": {k: after[k] - begun[k] if k.startswith("bytes") else after[k] for k in after}}
        if self._disk is None:  # read once: a step allocates nothing it does not need
            self._disk = (cached_disk(self.path),)
        disk = self._disk[0] if "started" in self._record else None
        if disk is not None:
            r, io = self._record, out["nvme"]
            out["offload"] = disk_roofline(r["started"] - t0, r["ended"] - r["started"], io["bytes_read"],
                                           io["bytes_written"], *disk)
        return out

    def grad_stats(self, g: torch.Tensor) -> tuple[float, bool] | None:
        return swap.grad_stats(g) if swap.on_disk(g) else None

    def move(self, leaf: torch.Tensor, to: str, device: torch.device | None = None) -> torch.Tensor:
        """Off the disk: the leaf's values read into host memory (onto ``device`` for DEVICE; a leaf
        kept on the device comes to the host for CPU). Onto it: a leaf goes there at init
        (``init_home``); one already there stays."""
        if to == CPU:
            return swap.load(leaf).cpu()
        if swap.on_disk(leaf) and to == DEVICE:
            values = swap.load(leaf)
            return values.to(device) if device is not None else values
        if to == NVME and not swap.on_disk(leaf):
            raise NotImplementedError("offload_nvme writes a unit's leaves to their swap files at init; moving "
                                      "a leaf onto the disk later is not supported yet")
        return leaf

    def init_home(self, step: Step, spec, places, group) -> "_DiskHome":
        """At ``Step.init``: the state's swap folder, its free-space check and its gradient files."""
        w, r = dist.world_size(group), dist.rank(group)
        accumulates = step.accumulates
        per_elem = state_bytes_per_element(step.update_part(below=self))
        sizes, need = [], 0
        on_disk = []  # (elements, bytes, unit name) of each parameter file read into the pool
        for i, (unit, place) in enumerate(zip(spec.units, places)):
            padded = unit.trainable.padded
            n = layout.home_numel(padded, w, place.params_sharded)
            n_opt = layout.home_numel(padded, w, place.opt_sharded or place.params_sharded)
            n_grad = layout.home_numel(padded, w, grad_is_shard(place, place.params_sharded))
            item = (place.param_dtype or unit.trainable.dtype).itemsize
            if self.params:  # frozen parameters are read into the pool too: the largest file sizes its buffers
                n_frozen = layout.home_numel(unit.frozen.padded, w, place.params_sharded)
                frozen_item = (place.frozen_dtype or unit.frozen.dtype).itemsize
                need += n * (item + unit.trainable.dtype.itemsize)  # the file, and its staging copy at init
                need += n_frozen * frozen_item
                on_disk += [(n, n * item, unit.name), (n_frozen, n_frozen * frozen_item, unit.name)]
            need += n_grad * (4 if accumulates else item)  # accumulate sums in fp32
            if place.opt_home == NVME:  # units a plan keeps in host memory have no state files
                need += n_opt * per_elem
            shard_start = layout.shard_start(r, layout.shard_numel(padded, w))
            sizes.append((n, n_grad, item, shard_start if place.params_sharded or place.opt_sharded else 0,
                          shard_start if n_grad != padded else 0))
        # a pool buffer: the largest file, at most buffer_size elements (a larger unit is read past the pool)
        buffer_bytes = max((min(nbytes, self.buffer_size * (nbytes // n)) for n, nbytes, _ in on_disk if n), default=0)
        device = swap.device_for(dist.compute_device(group))
        needs = self._host_bytes(spec, places, w, buffer_bytes, per_elem, accumulates, device.copies)
        kept = needs["optimizer state kept in host memory"] = host_state_bytes(spec, places, w, per_elem)
        less = "" if not kept else ("keep less optimizer state in host memory (a smaller host_budget=, or a plan "
                                    "made with one), " if self.optimizer else "put the optimizer state on disk "
                                    "(optimizer=True), ")
        check_host_memory("offload_nvme", needs, less + "lower buffer_count, buffer_size or sub_group_size, or make "
                                                        "smaller units")
        store = swap.SwapStore(self.path, aio_config=self.aio, buffer_count=self.buffer_count,
                               buffer_bytes=buffer_bytes, faults=self.faults, device=device)
        try:
            store.reserve(need)
            store.offsets = [s[3] for s in sizes]
            for i, (unit, place, (_, n_grad, _, _, grad_start)) in enumerate(zip(spec.units, places, sizes)):
                if n_grad:  # accumulate's sums are fp32; else the gradient's own dtype
                    dtype = torch.float32 if accumulates else (place.param_dtype or unit.trainable.dtype)
                    store.grads[i] = store.create(i, unit.name, "grad", n_grad, dtype, grad_start)
        except BaseException:
            store.close()  # a failed init leaves nothing behind (Step.init closes the home once it is made)
            raise
        return _DiskHome(store, r, self.piece)

    def _host_bytes(self, spec, places, w: int, buffer_bytes: int, per_elem: int, accumulates: bool,
                    copies: bool) -> dict[str, int]:
        """What this rank's host memory must hold at least, by part: the read pool, the update's
        staging sets (at most three of ``piece`` elements of parameters, gradients and optimizer
        state), the gradients' two staging buffers from a device, and the largest unit gathered
        where compute runs on the CPU."""
        per_piece, total, largest = 0, 0, 0
        for unit, place in zip(spec.units, places):
            item = (place.param_dtype or unit.trainable.dtype).itemsize
            per_piece = max(per_piece, item * self.params + (4 if accumulates else item) + per_elem * self.optimizer)
            total += layout.home_numel(unit.trainable.padded, w, place.opt_sharded or place.params_sharded)
            largest = max(largest, unit.trainable.padded * item)
        held = min(self.piece, total)
        sets = min(_Update.SLOTS, -(-total // held)) if held else 0
        out = {"read pool": self.buffer_count * buffer_bytes, "update staging": sets * held * per_piece}
        out["largest unit" if not copies else "gradient staging"] = largest if not copies else 2 * buffer_bytes
        return out


class _DiskHome:
    """``Step.init``'s leaves of units whose parameters live on disk, written as they are made
    (``Transform.init_home``)."""

    def __init__(self, store: swap.SwapStore, rank: int, piece: int):
        self.store, self.key, self.rank, self.piece = store, store.key, rank, piece

    def keep(self, i: int, unit, place: Placement, leaf: torch.Tensor, frozen: bool) -> torch.Tensor:
        if place.param_home != NVME or not leaf.numel():
            return leaf
        start = layout.shard_start(self.rank, leaf.numel()) if place.params_sharded else 0
        if not frozen:  # the optimizer's init reads these values back once
            return self.store.stage(i, unit.name, leaf, place.param_dtype or leaf.dtype, start)
        stored = leaf.to(place.frozen_dtype or leaf.dtype)  # frozen: written once, in their stored dtype
        return self.store.put(i, unit.name, "frozen", stored, start)

    def close(self) -> None:
        """After a failed ``Step.init``: remove the swap files and the folders init made."""
        self.store.close()

    def finish(self) -> None:
        self.store.finish_staged(self.piece)  # what the optimizer's init did not write (an eval step's init)
        trim_heap()  # init's per-unit temporaries: back to the OS, not left in malloc's heap


def offload_nvme(step: Step, path, *, params: bool = True, optimizer: bool = True, buffer_count: int = 5,
                 buffer_size: int = int(1e8), sub_group_size: int = int(1e9), aio: dict | None = None,
                 prefetch_bucket_size: int | None = None, max_live_parameters: int | None = None,
                 max_reuse_distance: int | None = None, collective_timeout: float | None = None,
                 faults: swap.Faults | None = None, host_budget: int | None = None,
                 plan: OffloadPlan | str | None = None) -> Step:
    """Keep parameters, gradients and optimizer state in swap files under ``path`` (module docstring).

    ``params``: parameter shards on disk too (needs zero3, or no stage);
    ``optimizer``: the optimizer state on disk (else in RAM, as offload_cpu);
    ``buffer_count`` x ``buffer_size`` (elements): the pool units are read
    into (a larger unit gets a buffer of its own while it is used, or on a
    GPU passes through the pool); ``sub_group_size``: elements of each tensor
    the update holds at once, at most ``buffer_size`` (each of three staging
    sets; a larger unit is updated in pieces); ``aio``: DeepSpeed's ``aio`` config section for
    ``zfunc.ops.aio``. The state owns its files: ``state.close()`` (or a
    ``with`` block) removes them; so does interpreter exit.
    ``prefetch_bucket_size``, ``max_live_parameters``, ``max_reuse_distance``,
    ``collective_timeout``: the coordinator's settings, as for ``zero3``: units
    are read from disk (then gathered) ahead of use along the recorded order.
    Settings given to the outermost transform that has any win.
    ``faults``: a ``zf.swap.Faults`` that tests arm to make a disk request fail.
    ``host_budget``: bytes of host memory for optimizer state: the first units' (forward order,
    first fit) stay there, the rest go to disk, so the disk moves only theirs each step
    (``zfunc.transforms.offload.plan.plan_for_host_budget``); ``plan``: such a split (an ``OffloadPlan`` with
    ``disk_units``, or the path of a saved one), from ``zf.plan_offload(step, model, host_budget=)``.
    """
    expect_step(step, "offload_nvme")
    if host_budget is not None and plan is not None:
        raise ValueError("offload_nvme: give one of host_budget= and plan=, which each say which units' optimizer "
                         "state stays in host memory")
    if (host_budget is not None or plan is not None) and not optimizer:
        raise ValueError("offload_nvme(optimizer=False) keeps every unit's optimizer state in host memory already: "
                         "drop host_budget=/plan=, or optimizer=False")
    host_budget = whole(host_budget, "offload_nvme", "host_budget")
    plan = as_plan(plan, "offload_nvme")
    if plan is not None and plan.device_units:
        raise ValueError(f"offload_nvme keeps no unit's update on the device, but this plan keeps "
                         f"{list(plan.device_units)[:3]} there; make it with zf.plan_offload(step, model, "
                         "host_budget=...), or use offload_cpu(plan=...)")
    if path is None or not str(path):
        raise ValueError("offload_nvme needs path=, a folder on a fast local disk for the swap files")
    buffer_count, buffer_size, sub_group_size = (
        whole(value, "offload_nvme", key, least=1, unit=unit) for key, value, unit in (
            ("buffer_count", buffer_count, "buffers"), ("buffer_size", buffer_size, "elements"),
            ("sub_group_size", sub_group_size, "elements")))
    return step.then(OffloadNvme(path, bool(params), bool(optimizer), buffer_count, buffer_size,
                                 sub_group_size, aio, prefetch_settings(
        prefetch_bucket_size=prefetch_bucket_size, max_live_parameters=max_live_parameters,
        max_reuse_distance=max_reuse_distance, collective_timeout=collective_timeout), faults, plan, host_budget))


def make_host_plan(spec, step, offload: OffloadNvme, plan, host_budget) -> OffloadPlan:
    """The plan given (checked against ``spec``'s units), or one made from ``host_budget``: units
    count this rank's part, at the state bytes of the optimizer inside ``offload``; the disk's rates
    (if ``zfunc.transforms.offload.rates.measure_disk`` measured them) predict its traffic."""
    units = rank_units(spec, step)
    state_bytes = state_bytes_per_element(step.update_part(below=offload))
    if plan is not None:
        plan.check(units, state_bytes)
        return plan
    return plan_for_host_budget(units, budget=host_budget, state_bytes=state_bytes,
                                disk=cached_disk(offload.path) if os.path.exists(offload.path) else None)
