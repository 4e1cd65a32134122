"""NVMe offload's update: the optimizer streamed over state held in swap files.

Units are streamed in sub-groups of at most ``min(sub_group_size, buffer_size)`` elements
(``piece_size``), a larger unit cut into pieces of that size (Adam is elementwise, as it is over
a shard): the next sub-group's master, moments and gradient are read while the current one is
updated by the inner optimizer (the fused CPU Adam), and the one before is written back, so the
update holds ``STAGING_SETS`` staging sets of a sub-group each. The optimizer sees one sub-group
at a time, other units stand in as empty tensors with no gradient; its step count, and each
unit's, advances once per step. Clipping folds into the step's ``GradInfo``, so it still sees the
global norm. DeepSpeed's default ``sub_group_size=1e9`` would hold a 1B-parameter part's whole
state in RAM, more than offload_cpu; ``buffer_size`` caps it.

The last sub-group stays in its staging set (``SwapStore.resident``): its writes finish behind
the step, the next forward reads its units from RAM, backward puts its gradients there instead of
on disk, and the next update starts with it (so the order runs back and forth, step after step).
A model whose part fits in one sub-group thus reads nothing back from disk: its state is written
through to the swap files each step. A write that fails behind the step is raised by the next use
of the state.

Init builds the optimizer state one unit at a time, a piece of at most the staging size at a
time, and writes it out, so init never holds more than a unit either.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any

import optree
import torch

from ... import swap
from ...buffers import trim as trim_heap
from ...ops import aio
from ...optim.base import GradInfo, Optimizer, apply_update
from ...optim.counts import is_count
from ...placement import NVME
from ...pytree import NAMESPACE, register_node
from ...state import master_weights
from ...tree import Params, held_count


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
                one = Params(params.spec, [values if j == i else _empty(x) for j, x in enumerate(leaves)],
                             starts={i: start})  # where the piece lies: a state held for some parameters needs it
                nodes, treedef = _flatten(optimizer.init(one))
                if merged is None:
                    merged = [list(n.leaves) if isinstance(n, Params) else n for n in nodes]
                    specs = [n.spec if isinstance(n, Params) else None for n in nodes]
                    kinds = _kinds(treedef.unflatten(nodes))
                for k, node in enumerate(nodes):
                    if isinstance(node, Params):
                        merged[k][i] = _keep_state(store, params, i, kinds[k], node.leaves[i], merged[k][i], start,
                                                   node.spec)
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


def _keep_state(store: swap.SwapStore, params: Params, i: int, kind: str, t: torch.Tensor, kept, start: int,
                spec=None):
    """Unit ``i``'s state tensor ``t`` as init made it for the piece at element ``start``: where the
    state lives on disk, written into its swap file (made at the first piece) and that file's
    placeholder returned; else ``t`` itself (a per-unit counter: the first piece's). ``spec``: the
    state node's, whose ``held`` (a state for some parameters only: zfunc.optim.held) makes its file
    hold just their elements."""
    if (spec is not None and spec.held is not None and params.spec.placements[i].opt_home == NVME
            and t.dim() == 1 and not is_count(t)):
        lo, n = params.leaf_start(i), params.leaves[i].numel()
        total = held_count(spec, i, lo, lo + n)
        if not total:  # it holds none of this unit: an empty tensor in RAM
            return t if start == 0 else kept
        if start == 0:
            kept = store.create(i, params.spec.model.units[i].name, kind, total, t.dtype, store.offsets[i])
        if t.numel():
            store.write_now(t, kept, held_count(spec, i, lo, lo + start) * t.element_size())
        return kept
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


STAGING_SETS = 3  # the update's staging sets: one read ahead, one computed, one written behind


class _Update:
    """One streamed update: sub-group k computes while k+1 is read and k-1 written. A sub-group is a
    list of pieces ``(unit, start, stop)``: elements ``start:stop`` of the unit's parameters,
    gradient and state tensors."""

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

    def _cut(self, k: int, piece) -> tuple[int, int]:
        """Where ``piece``'s elements lie in state node ``k``'s leaf: the same, or for a state held for
        some parameters only (zfunc.optim.held), their elements of it."""
        i, a, b = piece
        spec = self.nodes[k].spec
        if spec.held is None:
            return a, b
        lo = self.params.leaf_start(i)
        return held_count(spec, i, lo, lo + a), held_count(spec, i, lo, lo + b)

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
                c, d = self._cut(k, piece)
                out.append(("o", k, t[c:d], True))
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
            arenas[slot] = aio.aligned_empty(max([nbytes, *(sum(self._plan(g)[1]) for g in self.groups)]))
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
                    c, d = self._cut(k, piece)
                    leaves.append(_held(bufs, ("o", k, piece), lambda: t[c:d]))
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
                c, d = self._cut(k, piece)
                if swap.on_disk(old):
                    self._write(handle, bufs, ("o", k, piece), new, old[c:d])
                elif not is_count(old):
                    if new is not nodes_in[k].leaves[i]:
                        old[c:d].copy_(new)
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
                    ahead = None if last else self._read(groups[n + 1], (first + n + 1) % STAGING_SETS, reader)
                    handed, returned = self._compute(group, bufs)
                    new_nodes = returned[1]
                    store.wait(writer, "writing the optimizer state")
                    wrote = True
                    handle = store._handle() if last else writer
                    store.faults.fire("update", handle)
                    self._write_back(group, bufs, handed, returned, handle)
                    if last:
                        store.keep_resident((first + n) % STAGING_SETS, group, bufs, handle, self._files(group))
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
