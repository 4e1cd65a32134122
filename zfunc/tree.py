"""Units, flat layouts and the sharded-parameter pytree.

A model's parameters are grouped into *units* (by default each child of every
``nn.ModuleList``, plus a root unit for the rest). Each unit is one flat 1-D
buffer with a static layout: which named parameters it holds, their shapes and
offsets, padded to a multiple of the world size so it splits evenly. Frozen
parameters go to a second flat buffer of the same unit, so they never get a
gradient or optimizer state. Tied parameters are stored once, in the unit of
their first name.

``Params`` is the pytree node holding one tensor per unit. Its static part
(``ParamsSpec``) records, per unit, whether the tensor held is the full buffer
or this rank's shard; the leaves are plain tensors, so optimizers just
``tree_map`` over them.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch
from torch import nn

from . import compiled, dist, layout
from .ops._names import nearest
from .placement import Placement, optimizer_slices
from .pytree import register_node


@dataclass(frozen=True)
class Entry:
    """One parameter inside a unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Segment:
    """A flat buffer's layout: its entries, length and padded length."""

    entries: tuple[Entry, ...]
    dtype: torch.dtype
    numel: int
    padded: int

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat``, one per entry. One ``split`` makes them all, so the
        gradient of the flat buffer is a single concatenation in backward, not a
        full-size zero-filled tensor per entry as slicing would give."""
        if not self.entries:
            return {}
        sizes, keep, pos = [], [], 0
        for e in self.entries:  # an owner layout (``_segment``) leaves gaps between some entries
            if e.offset > pos:
                sizes.append(e.offset - pos)
                keep.append(False)
            sizes.append(e.numel)
            keep.append(True)
            pos = e.offset + e.numel
        if flat.numel() > pos:
            sizes.append(flat.numel() - pos)
            keep.append(False)
        chunks = [c for c, k in zip(flat.split(sizes), keep) if k]
        return {e.name: c.view(e.shape) for e, c in zip(self.entries, chunks)}


@dataclass(frozen=True)
class Unit:
    """A group of parameters materialized together: one module's subtree."""

    name: str  # module path; "" is the root unit
    trainable: Segment
    frozen: Segment
    located: tuple[str, ...]  # every parameter name (aliases included) living in this unit's modules


@dataclass(frozen=True)
class ModelSpec:
    """The static description of a model's parameters, shared by all its trees."""

    units: tuple[Unit, ...]
    owner: tuple[tuple[str, tuple[int, bool]], ...]  # name (aliases too) -> (unit, trainable)
    canonical: tuple[tuple[str, str], ...]  # alias -> first name
    # buffers registered with persistent=False: in the state (forward reads them), not in the state_dict
    transient_buffers: tuple[str, ...] = ()

    def owner_of(self, name: str) -> tuple[int, bool]:
        return self._owner[name]

    def canonical_name(self, name: str) -> str:
        return self._canonical.get(name, name)

    def __post_init__(self):
        object.__setattr__(self, "_owner", dict(self.owner))
        object.__setattr__(self, "_canonical", dict(self.canonical))

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.owner)

    def check_model(self, model: nn.Module) -> None:
        """Raise if ``model`` is not the model this spec was built from."""
        names = tuple(n for n, _ in compiled.named_parameters(model, remove_duplicate=False))
        if names != self.parameter_names:
            ours, theirs = set(self.parameter_names), set(names)
            missing = sorted(ours - theirs)[:3]
            extra = sorted(theirs - ours)[:3]
            raise ValueError(
                "this state was built for a different model: "
                f"parameters the state has but the model lacks: {missing or 'none'}; "
                f"parameters the model has but the state lacks: {extra or 'none'}. "
                "Pass the model the state was initialized from."
            )
        for name, p in compiled.named_parameters(model):
            unit, trainable = self.owner_of(name)
            seg = self.units[unit].trainable if trainable else self.units[unit].frozen
            entry = next(e for e in seg.entries if e.name == name)
            if tuple(p.shape) != entry.shape:
                raise ValueError(
                    f"this state was built for a different model: parameter {name!r} has shape "
                    f"{tuple(p.shape)} in the model but {entry.shape} in the state"
                )


def unit_modules(model: nn.Module, units) -> list[str]:
    """Module paths (plain: zfunc.compiled) that become units, in module order (the root is implicit)."""
    modules = compiled.modules_by_path(model)
    if units is None:
        return [
            f"{name}.{child}" if name else child
            for name, mod in modules.items()
            if isinstance(mod, nn.ModuleList)
            for child, _ in mod.named_children()
        ]
    if callable(units):
        return [name for name, mod in modules.items() if name and units(name, mod)]
    if isinstance(units, str):
        raise TypeError("units must be a list of module names, a predicate, or None; got a string")
    wanted = list(units)
    for name in wanted:
        if name not in modules or name == "":
            near = nearest(name, [m for m in modules if m])
            hint = f" Did you mean {near!r}?" if near else ""
            raise ValueError(f"unit policy names module {name!r}, which the model does not have.{hint}")
    return [name for name in modules if name in set(wanted)]


def _location(param_name: str, unit_paths: Sequence[str]) -> int:
    """Index (1-based; 0 is root) of the deepest unit whose module holds ``param_name``."""
    best, depth = 0, -1
    for i, path in enumerate(unit_paths, start=1):
        if param_name.startswith(path + ".") and path.count(".") > depth:
            best, depth = i, path.count(".")
    return best


def split_by_dtype(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` and, where a unit would mix parameter dtypes (fp32 norms in a bf16 model), the modules
    that own its parameters of other dtypes than its most common one, each a unit of its own (nested
    in it, as a ``ModuleList`` inside a unit is), so every unit is one flat buffer of one dtype."""
    order = {name: k for k, name in enumerate(compiled.modules_by_path(model))}
    while True:
        groups: dict[tuple[int, bool], dict[torch.dtype, list[tuple[str, int]]]] = {}
        seen: set[int] = set()
        for name, p in compiled.named_parameters(model, remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                group = groups.setdefault((_location(name, paths), p.requires_grad), {})
                group.setdefault(p.dtype, []).append((name, p.numel()))
        extra = set()
        for (where, _), by_dtype in groups.items():
            common = max(by_dtype, key=lambda d: sum(n for _, n in by_dtype[d]))
            unit = ([""] + list(paths))[where]
            for dtype, params in by_dtype.items():
                owners = {name.rpartition(".")[0] for name, _ in params} if dtype != common else set()
                if unit in owners:
                    raise ValueError(
                        f"module {unit or '<root>'!r} mixes parameter dtypes {sorted(map(str, by_dtype))} in its own "
                        "parameters, which cannot be one flat buffer: cast them to one dtype (mixed precision is a "
                        "transform, not a model dtype)")
                extra |= owners
        if not extra:
            return list(paths)
        paths = sorted(set(paths) | extra, key=order.__getitem__)


MAX_OWNER_PADDING = 0.5  # an owner layout may add at most this share of the unit's elements as padding
BALANCE_BEAM = 32  # the owner layout's search keeps this many partial layouts (``owner_offsets``)
BALANCE_MAX_ENTRIES = 512  # a unit with more entries is laid out in order, compactly (not by cost)
BALANCE_WIDER = (1, 2, 4, 8, 16)  # shards this many 64ths wider than the smallest are tried too (``owner_offsets``)
BALANCE_SLACK = 0.25  # a wider shard only while the busiest rank is above the mean by this share of the largest cost


def _segment(params: list[tuple[str, torch.Tensor]], world: int, whole=None,
             load: list[float] | None = None) -> Segment:
    """The flat layout of ``params``: one after another, padded to a multiple of ``world``; or, where
    ``whole`` (a predicate on names) picks parameters an optimizer updates whole, the owner layout
    (``owner_offsets``) when it costs at most ``MAX_OWNER_PADDING`` more elements. ``load``: each
    rank's cost so far (``whole.cost(name, shape)``, default the elements), which the owner layout
    balances and adds this unit's to."""
    dtypes = {p.dtype for _, p in params}
    dtype = dtypes.pop() if dtypes else torch.float32
    sizes = [p.numel() for _, p in params]
    total = sum(sizes)
    offsets, padded = None, layout.padded_numel(total, world)
    if whole is not None and world > 1 and any(whole(name) for name, _ in params):
        flags = [bool(whole(name)) for name, _ in params]
        cost = getattr(whole, "cost", None)
        costs = [float(cost(name, tuple(p.shape)) if cost is not None else p.numel()) if w else 0.0
                 for (name, p), w in zip(params, flags)]
        trial = None if load is None else list(load)
        limit = padded + int(MAX_OWNER_PADDING * total)
        found = owner_offsets(sizes, flags, world, costs, trial, limit)
        if found is not None and found[1] <= padded + MAX_OWNER_PADDING * total:
            offsets, padded = found
            if load is not None:
                load[:] = trial
    if offsets is None:
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    entries = tuple(Entry(name, tuple(p.shape), o) for (name, p), o in zip(params, offsets))
    end = max((o + n for o, n in zip(offsets, sizes)), default=0)
    return Segment(entries, dtype, end, padded)


def owner_offsets(sizes: list[int], whole: list[bool], world: int, costs: list[float] | None = None,
                  load: list[float] | None = None, limit: int | None = None) -> tuple[list[int], int] | None:
    """Offsets, in order, that put each ``whole`` entry inside one of ``world`` equal shards (the others
    may cross), and the padded length ``world * n`` for the smallest shard ``n`` found; None if the
    layout cannot be cut so (no entry is whole). A whole entry that would cross a shard's end starts
    at the next shard's, leaving a gap the flat buffer holds as zeros.

    With ``costs`` (per entry, the update's cost of a whole one) and ``load`` (each rank's cost so
    far, from the units laid out before; updated in place), the shard of each whole entry is chosen
    to balance the ranks' costs (``_balance``): still in order and inside the same ``world * n``
    elements (so the same padding), a whole entry may start at a later shard than the next free
    element's, leaving a larger gap, so that the cost lands on the ranks with the least so far."""
    if not any(whole):
        return None

    def place(n):
        pos, out = 0, []
        for size, w in zip(sizes, whole):
            if w and size and pos // n != (pos + size - 1) // n:
                pos = -(-pos // n) * n
            out.append(pos)
            pos += size
        return out if pos <= world * n else None

    lo = max(-(-sum(sizes) // world), max((s for s, w in zip(sizes, whole) if w), default=1), 1)
    hi = lo
    while place(hi) is None:
        hi *= 2
    while lo < hi:  # the smallest n that fits, by bisection (fitting is monotone in n but for rare ties)
        mid = (lo + hi) // 2
        if place(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    if costs is None or load is None or len(sizes) > BALANCE_MAX_ENTRIES:
        return place(hi), world * hi
    tried, even = [], False
    for n in sorted({hi, *(-(-hi * (64 + k) // 64) for k in BALANCE_WIDER)}):  # wider shards: more freedom
        if limit is not None and world * n > limit and n > hi:
            continue
        offsets, add = _balance(sizes, whole, world, n, costs, load)
        after = [a + b for a, b in zip(load, add)]
        tried.append((sorted(after, reverse=True), n, offsets, add))
        even = max(after) <= sum(after) / world + BALANCE_SLACK * max(costs)
        if even:
            break  # even enough: the narrowest such (the least padding)
    _, n, offsets, add = tried[-1] if even else min(tried, key=lambda t: (t[0], t[1]))
    for r in range(world):
        load[r] += add[r]
    return offsets, world * n


def _balance(sizes, whole, world: int, n: int, costs, load: list[float]) -> tuple[list[int], tuple[float, ...]]:
    """Offsets in order within ``world`` shards of ``n`` elements, each whole entry inside one shard,
    choosing each whole entry's shard so that the ranks' costs (``load`` plus this unit's) stay even:
    a beam search over the entries in order, each partial layout scored by its ranks' costs sorted
    from the largest (the least largest first), ties by the fewest elements used. Returns the offsets
    and this unit's cost per rank. Deterministic: every rank lays the unit out alike."""
    # latest[k]: the last element entries k.. can start from and still fit (placed compactly from
    # there: where they end grows with where they start, so the starts that fit are 0..latest[k])
    latest = [world * n] * (len(sizes) + 1)
    for k in range(len(sizes) - 1, -1, -1):
        size, t = sizes[k], latest[k + 1] - sizes[k]
        if whole[k] and size and t >= 0 and t // n != (t + size - 1) // n:
            t = (t + size - 1) // n * n - size  # end at the shard's end before
        latest[k] = t

    def fits_from(k, pos):  # can entries k.. still be placed from pos (compactly)?
        return pos <= latest[k]

    states = [(0, (), (0.0,) * world)]  # (next free element, offsets so far, this unit's cost per rank)
    for k, (size, w) in enumerate(zip(sizes, whole)):
        grown = []
        for pos, offs, add in states:
            if not (w and size):
                grown.append((pos + size, offs + (pos,), add))
                continue
            first = pos // n
            starts = [(first, pos)] if (pos + size - 1) // n == first else []
            starts += [(s, s * n) for s in range(first + 1, world)]
            for s, at in starts:
                if fits_from(k + 1, at + size):
                    more = list(add)
                    more[s] += costs[k]
                    grown.append((at + size, offs + (at,), tuple(more)))
        seen, states = set(), []
        for st in sorted(grown, key=lambda st: (sorted((a + b for a, b in zip(load, st[2])), reverse=True), st[0],
                                               st[1])):
            key = (st[0], st[2])
            if key not in seen:
                seen.add(key)
                states.append(st)
                if len(states) == BALANCE_BEAM:
                    break
    pos, offsets, add = states[0]
    return list(offsets), add


def build_spec(model: nn.Module, units=None, world: int = 1, whole=None) -> ModelSpec:
    """Group ``model``'s parameters into units and lay each unit out flat; ``whole``: a predicate on
    parameter names, the parameters an optimizer updates whole, each then kept inside one of the
    ``world`` shards where that costs little (``_segment``)."""
    for name, p in compiled.named_parameters(model):
        if getattr(p, "_zfunc_name", None) is not None:
            raise ValueError(
                f"parameter {name!r} is held by a zfunc State: this model's storage was already taken "
                "by Step.init. Build a fresh model, or load weights with zf.gather_params."
            )
    paths = split_by_dtype(model, unit_modules(model, units))
    first_name: dict[int, str] = {}
    canonical: dict[str, str] = {}
    located: list[list[str]] = [[] for _ in range(len(paths) + 1)]
    members: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(len(paths) + 1)]
    for name, p in compiled.named_parameters(model, remove_duplicate=False):
        where = _location(name, paths)
        located[where].append(name)
        if id(p) in first_name:
            canonical[name] = first_name[id(p)]
            continue
        first_name[id(p)] = name
        members[where].append((name, p))
    built, owner_of_first = [], {}
    load = [0.0] * world  # each rank's cost of the whole parameters it owns so far (the owner layout's balance)
    for i, path in enumerate([""] + paths):
        trainable = [(n, p) for n, p in members[i] if p.requires_grad]
        frozen = [(n, p) for n, p in members[i] if not p.requires_grad]
        for n, p in members[i]:
            owner_of_first[n] = (len(built), p.requires_grad)
        if members[i] or located[i]:
            built.append(
                Unit(path, _segment(trainable, world, whole, load), _segment(frozen, world), tuple(located[i]))
            )
    owner = tuple(
        (name, owner_of_first[canonical.get(name, name)])
        for name, _ in compiled.named_parameters(model, remove_duplicate=False)
    )
    transient = dict.fromkeys(f"{path}.{b}" if path else b for path, m in compiled.named_modules(model)
                              for b in m._non_persistent_buffers_set if m._buffers.get(b) is not None)
    return ModelSpec(tuple(built), owner, tuple(canonical.items()), tuple(transient))


def compile_units(model: nn.Module, units=None, **compile_kwargs) -> nn.Module:
    """Compile each unit's module in place, torchtitan's recipe: by default every child of every
    ``nn.ModuleList``, else the modules of the unit policy ``units`` (as zf.zero3's), with
    ``torch.compile``'s keywords (zfunc.compiled.compile_in_place). Call it before ``step.init``;
    returns ``model``. zfunc gathers a unit outside its compiled code, so each block is one graph
    (``fullgraph=True`` holds)."""
    for path in unit_modules(model, units):
        compiled.compile_in_place(compiled.owner(model, path), **compile_kwargs)
    return model


# ---------------------------------------------------------------------------
# The Params pytree node.


@dataclass(frozen=True)
class ParamsSpec:
    """Static half of a ``Params`` node: plain data (no process group object).

    ``sharded`` says per unit whether the leaf holds this rank's shard (else
    the full buffer); ``group`` is ``dist.group_key`` of the group.
    """

    model: ModelSpec
    placements: tuple[Placement, ...]
    sharded: tuple[bool, ...]
    frozen: bool  # the frozen segments rather than the trainable ones
    group: tuple[int, ...] | None = None
    swap: str | None = None  # the swap store (zfunc.swap) holding leaves on disk, by its key
    # optimizer state of some parameters only (zf.optim.multi's members): per unit, which of its entries
    # the leaves hold; each leaf holds just those entries' elements of the parameters' leaf, in order
    # (``held_runs``); None: laid out like the parameters
    held: tuple[tuple[bool, ...], ...] | None = None

    def segment(self, unit: int) -> Segment:
        u = self.model.units[unit]
        return u.frozen if self.frozen else u.trainable

    @property
    def process_group(self):
        return dist.group_of(self.group)


class UpdateFailed(RuntimeError):
    """Raised by every use of a state whose optimizer update failed partway (``Fault``)."""


class Fault:
    """The first error of one optimizer update, shared by every ``Params`` it wrote and by those of
    the state it was given. Set once and never cleared: a half-updated state, and the state it was
    updated from, refuse every later use (``check``), however often they are tried. ``agreed``:
    every rank of the group knows (the step's agreement said so), so each refuses at once."""

    __slots__ = ("cause", "where", "agreed", "_lock")

    def __init__(self):
        self.cause: BaseException | None = None
        self.where = ""
        self.agreed = False
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        return self.cause is not None

    def record(self, cause: BaseException, where: str) -> None:
        """Keep ``cause`` (raised by ``where``) if it is the first."""
        with self._lock:
            if self.cause is None:
                self.where, self.cause = where, cause

    def error(self) -> UpdateFailed:
        cause = self.cause
        error = UpdateFailed(
            f"{self.where} failed ({type(cause).__name__}: {str(cause).strip()}), so this state's parameters and "
            "optimizer state are partly updated or no longer match the other ranks', as are those of the state "
            "that step was given: it refuses every use (a step, a checkpoint, zf.gather_params, "
            "zf.memory_report), so it refuses to train on. "
            "Fix the cause, then build the state again with step.init and load your last checkpoint "
            "(zf.checkpoint.load)")
        error.__cause__ = cause
        return error

    def check(self) -> None:
        if self.cause is not None:
            raise self.error()


class Params:
    """One tensor per unit: a full flat buffer or this rank's shard of it.

    A pytree node (optree namespace ``zfunc`` and torch's pytree); its leaves
    are the tensors, its static data the ``ParamsSpec``. In a gradient, a
    leaf is ``None`` for a unit no rank used (it gets no update, as
    ``torch.optim`` skips a parameter whose ``.grad`` is None).

    A full buffer may still be filling from an all-gather that ``from_local``
    started (stages 1 and 2 after an update): ``leaves`` (and so flattening)
    waits for every such gather, while the next step's forward waits for each
    unit only when it first uses it (``leaf_when_ready``), so the gathers
    overlap that forward as DDP's all-reduce overlaps backward.

    ``fault``: the ``Fault`` of the update that wrote these leaves (or was given them), if any:
    once it holds an error, every read of the values raises it (``leaves``), every time.
    """

    __slots__ = ("spec", "_leaves", "_filling", "_starts", "fault")

    def __init__(self, spec: ParamsSpec, leaves: Iterable[torch.Tensor | None], filling=None, starts=None,
                 fault: Fault | None = None):
        self.spec = spec
        self._leaves = tuple(leaves)
        self._filling: dict[int, dist.Pending] = dict(filling or {})  # unit -> all-gather in flight
        # unit -> where its leaf starts within the unit's home leaf, for a leaf that is a piece of it
        # (offload_nvme updates a large unit a piece at a time)
        self._starts: dict[int, int] = dict(starts or {})
        self.fault = fault

    @property
    def leaves(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors, complete (waits for all-gathers and updates still filling them); raises, every
        time, if the update that wrote them failed (``Fault``)."""
        if self.fault is not None:
            self.fault.check()
        for unit in list(self._filling):
            self._wait(unit)
        return self._leaves

    @property
    def leaves_in_flight(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors without waiting for what may still be writing them: for their shapes,
        dtypes and devices only."""
        return self._leaves

    def leaf_when_ready(self, unit: int):
        """``(leaf, wait)``: unit ``unit``'s tensor and a function that returns
        once it is complete; use the tensor's values only after calling it.

        For a step's forward: where the update that writes the unit failed, ``wait`` returns all the
        same (the values are what the update left), so that every rank reaches the step's agreement,
        which refuses the state on all of them (``zfunc.agreement.agree``)."""
        return self._leaves[unit], lambda: self._wait(unit, refused_later=True)

    def _wait(self, unit: int, refused_later: bool = False) -> None:
        pending = self._filling.get(unit)
        if pending is None:
            return
        try:
            pending.wait()
        except UpdateFailed:  # kept: the next reader raises it again
            if not refused_later:
                raise
            return
        self._filling.pop(unit, None)

    def waiting_for(self, filling: dict, fault: Fault | None = None) -> "Params":
        """These leaves, with each unit in ``filling`` (unit -> an object whose ``wait()`` returns
        once its values are complete: offload_cpu's update running behind the next forward)
        waited for as an all-gather still filling it is; the leaves' own waits carry over.
        ``fault``: the update's, which its waits raise."""
        return Params(self.spec, self._leaves, {**self._filling, **filling}, self._starts, fault or self.fault)

    def parameter_ranges(self, unit: int) -> list[tuple[int, int]]:
        """Where each parameter of unit ``unit`` lies in its leaf, ``(start, stop)`` in the leaf's
        elements: the whole buffer's offsets, or a shard's (empty where the shard holds none of it)."""
        leaf = self._leaves[unit]
        start = self._starts.get(unit, 0)
        if self.spec.sharded[unit]:
            home = layout.home_numel(self.spec.segment(unit).padded, dist.world_size(self.spec.process_group), True)
            start += layout.shard_start(dist.rank(self.spec.process_group), home)
        stop = start + leaf.numel()
        return [(min(max(e.offset, start), stop) - start, min(max(e.offset + e.numel, start), stop) - start)
                for e in self.spec.segment(unit).entries]

    def leaf_start(self, unit: int) -> int:
        """Where unit ``unit``'s leaf starts in the unit's padded flat buffer (its shard's start, and
        where a piece of it starts: offload_nvme's)."""
        start = self._starts.get(unit, 0)
        if self.spec.sharded[unit]:
            home = layout.home_numel(self.spec.segment(unit).padded, dist.world_size(self.spec.process_group), True)
            start += layout.shard_start(dist.rank(self.spec.process_group), home)
        return start

    def __repr__(self) -> str:
        units = ", ".join(
            f"{u.name or '<root>'}:{'shard' if s else 'full'}[{'unused' if t is None else t.numel()}]"
            for u, s, t in zip(self.spec.model.units, self.spec.sharded, self._leaves)
        )
        return f"Params({units})"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._leaves if t is not None)

    def sum_of_squares(self) -> torch.Tensor:
        """Whole-model sum of squares: shards are summed across the group.

        Accumulated on the leaves' device, which is the group's device (a
        nccl group cannot reduce a CPU tensor).
        """
        leaves = [(t, s) for t, s in zip(self.leaves, self.spec.sharded) if t is not None]
        device = leaves[0][0].device if leaves else torch.device("cpu")
        shard = torch.zeros((), dtype=torch.float32, device=device)
        full = torch.zeros((), dtype=torch.float32, device=device)
        for t, sharded in leaves:
            if t.numel():
                part = t.detach().float().pow(2).sum().to(device)
                if sharded:
                    shard += part
                else:
                    full += part
        if any(self.spec.sharded):
            dist.all_reduce_sum(shard, self.spec.process_group)
        return shard + full

    def local(self) -> "Params":
        """The part of each unit this rank's optimizer updates.

        Units whose optimizer state is sharded but whose leaf holds the full
        buffer are sliced (a view: updating it updates the full buffer).
        """
        group = self.spec.process_group
        r, w = dist.rank(group), dist.world_size(group)
        leaves, sharded = [], []
        for t, held_shard, place in zip(self.leaves, self.spec.sharded, self.spec.placements):
            if optimizer_slices(place, held_shard):
                leaves.append(None if t is None else layout.shard(t, r, w))
                sharded.append(True)
            else:
                leaves.append(t)
                sharded.append(held_shard)
        return Params(replace(self.spec, sharded=tuple(sharded)), leaves)

    def from_local(self, local: "Params") -> "Params":
        """Inverse of ``local``: all-gather slices back into the full buffers, in place.

        Returns at once: the gathers fill the buffers in the background (see
        the class docstring for who waits for them).
        """
        group = self.spec.process_group
        r, w = dist.rank(group), dist.world_size(group)
        leaves, filling = [], {}
        for i, (t, lt, held_shard, lheld) in enumerate(
            zip(self.leaves, local._leaves, self.spec.sharded, local.spec.sharded)
        ):
            if lheld and not held_shard:
                local._wait(i)  # its slice is complete before it is copied and gathered (raises if it failed)
                mine = layout.shard(t, r, w)
                if lt.data_ptr() != mine.data_ptr():  # the optimizer returned new tensors
                    mine.copy_(lt)
                if w > 1:
                    filling[i] = dist.all_gather_inplace_start(t, group)
                leaves.append(t)
            else:
                leaves.append(lt)
                if i in local._filling:  # still being written (offload_cpu's update behind the forward)
                    filling[i] = local._filling[i]
        return Params(self.spec, leaves, filling, fault=local.fault)


register_node(Params, lambda p: (p.leaves, p.spec), lambda spec, leaves: Params(spec, leaves))


# ---------------------------------------------------------------------------
# State held for some parameters only (``ParamsSpec.held``).


def holding(spec: ParamsSpec, chosen) -> ParamsSpec:
    """``spec`` for a state that holds the entries whose (canonical) names ``chosen`` selects only."""
    model = spec.model
    return replace(spec, held=tuple(tuple(bool(chosen(model.canonical_name(e.name))) for e in spec.segment(i).entries)
                                    for i in range(len(spec.sharded))))


def held_runs(spec: ParamsSpec, unit: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The elements of ``[lo, hi)`` of unit ``unit``'s padded flat buffer that a state with ``spec.held``
    holds, as runs ``[a, b)`` in order (neighbouring entries merged): its leaf for the part of the
    parameters' leaf that covers ``[lo, hi)`` is these runs' elements, one after another."""
    out: list[list[int]] = []
    for e, on in zip(spec.segment(unit).entries, spec.held[unit]):
        a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
        if on and a < b:
            if out and out[-1][1] == a:
                out[-1][1] = b
            else:
                out.append([a, b])
    return [(a, b) for a, b in out]


def held_count(spec: ParamsSpec, unit: int, lo: int, hi: int) -> int:
    """Elements of ``[lo, hi)`` of unit ``unit``'s buffer that a state with ``spec.held`` holds."""
    return sum(b - a for a, b in held_runs(spec, unit, lo, hi))


def expand_held(spec: ParamsSpec, unit: int, compact: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """A held leaf (``compact``, for ``[lo, lo + n)`` of the unit's buffer) laid out like the
    parameters' leaf: ``n`` elements, zeros where it holds nothing."""
    full = torch.zeros(n, dtype=compact.dtype, device=compact.device)
    at = 0
    for a, b in held_runs(spec, unit, lo, lo + n):
        full[a - lo : b - lo].copy_(compact[at : at + b - a])
        at += b - a
    return full


def compact_held(spec: ParamsSpec, unit: int, full: torch.Tensor, lo: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``expand_held``: the held elements of ``full`` (``[lo, lo + len(full))`` of the
    unit's buffer), into ``out`` if given."""
    runs = held_runs(spec, unit, lo, lo + full.numel())
    if out is None:
        out = torch.empty(sum(b - a for a, b in runs), dtype=full.dtype, device=full.device)
    at = 0
    for a, b in runs:
        out[at : at + b - a].copy_(full[a - lo : b - lo])
        at += b - a
    return out
