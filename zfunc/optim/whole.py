"""Whole-tensor optimizers: an update that needs each parameter whole (Muon's Newton-Schulz,
Adafactor's row and column statistics, any ``torch.optim`` class), run over zfunc's flat buffers.

An elementwise optimizer (adamw, adam, sgd) updates any slice of a flat buffer. A whole-tensor one is
a :class:`Rule`: ``update(items, hyper)`` over :class:`Item` values, each one parameter with its
true gradient and its state as whole tensors, updated in place. :func:`optimizer` makes it an
``Optimizer`` (zfunc.optim.base) that

* finds each parameter in its unit's leaf (a view where the leaf holds it whole);
* under ZeRO (the leaf is this rank's shard) has each parameter updated by its owner
  (zfunc.optim.owners): where the shards cut a parameter, its unit is all-gathered (gradient,
  parameters and the state laid out like them, in one buffer) and the owners' results are summed
  back in one all-reduce, each rank keeping its shard;
* takes the step's ``info`` (the gradients' scale, ``live``: a parameter without a gradient is not
  updated, as ``torch.optim`` skips a ``None`` grad) and ``lowp_params`` (mixed precision's copies);
* keeps its state as an explicit pytree (``WholeState``): ``shaped``, the state with each
  parameter's shape (Muon's momentum), laid out like the parameters, so sharding, offload and
  checkpoints treat it as they treat Adam's moments; ``slots``, the rest (Adafactor's factors,
  torch's ``step``), per parameter, made when the state is made and kept on every rank (small:
  about rows + columns per matrix), its owner's values shared after each update.

Every hyperparameter is a number or a schedule ``step -> value`` and ``groups`` work as for adamw
(zfunc.optim.groups).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import optree
import torch

from .. import dist
from ..pytree import NAMESPACE, tree_flatten, tree_map
from ..tree import Params, compact_held, expand_held, held_count
from .base import GradInfo, Optimizer, PyTree
from .counts import counts_like, zero_count, zero_steps
from .groups import Labels, at, leaf_names, resolve
from .held import check_held, held_zeros, is_held
from .lr import as_schedule
from .owners import Cost, Placed, assign, numel_cost


class WholeState(NamedTuple):
    count: torch.Tensor  # 0-d int64 on CPU: updates applied so far (the schedule's step)
    steps: PyTree  # updates each parameter got: ``zero_steps``
    shaped: dict[str, PyTree]  # state key -> a tree laid out like params (fp32 or wider)
    slots: dict[str, dict[str, torch.Tensor]]  # parameter name -> its other state (every rank: _share_slots)


@dataclass
class Item:
    """One parameter, whole: updated in place by a rule's ``update``."""

    name: str
    param: torch.Tensor  # its values (fp32 or wider), written in place
    grad: torch.Tensor  # its true gradient, a copy in the parameter's dtype
    state: dict[str, torch.Tensor]  # its shaped state (views, write in place) and its slots (may be replaced)
    step: int  # updates it had before this one


@dataclass(frozen=True)
class Rule:
    """What makes an optimizer whole-tensor: see the module docstring."""

    name: str
    update: Callable[[list[Item], dict], None]
    shaped: tuple[str, ...] = ()  # state keys with the parameter's shape (zero at first)
    # (name, shape, dtype, device) -> the parameter's other state, zero; the same keys on every rank
    init_slots: Callable[[str, tuple[int, ...], torch.dtype, torch.device], dict] | None = None
    cost: Cost = numel_cost  # the update's cost for a shape, which owners balance
    check_param: Callable[[str, tuple[int, ...]], None] | None = None  # raises for a parameter it cannot update


def optimizer(rule: Rule, hyper: dict, check: Callable[[dict], None], groups=(), select=None) -> Optimizer:
    """``rule`` as an ``Optimizer`` with hyperparameters ``hyper`` (``lr`` among them) and
    ``groups``; ``select``: the parameter names it updates (a predicate; None: all), as
    ``zf.optim.multi`` hands each optimizer its own."""
    schedule_lr = as_schedule(rule.name, hyper["lr"])
    hypers = resolve(rule.name, hyper, groups, check)
    labels = Labels(rule.name, groups)
    owners = _Owners(rule, select)

    def init(params):
        labels.check_names(params)
        shaped = {k: (held_zeros(params, select, _zeros_master) if select is not None and isinstance(params, Params)
                      else tree_map(_zeros_master, params)) for k in rule.shaped}
        slots: dict[str, dict] = {}
        leaves, _ = tree_flatten(params)
        for i, placed in enumerate(owners.of(params, leaves)):
            for p in placed:
                if rule.check_param is not None:
                    rule.check_param(p.name, p.shape)
                if rule.init_slots is not None:  # on every rank (see _share_slots)
                    slots[p.name] = rule.init_slots(p.name, p.shape, _master_dtype(leaves[i].dtype), leaves[i].device)
        return WholeState(zero_count(), zero_steps(params), shaped, slots)

    def update(grads, opt_state, params, *, info: GradInfo | None = None, lowp_params=None):
        p_leaves, spec = tree_flatten(params)
        g_leaves = _grads_like(grads, params)
        shaped = {k: tree_flatten(v)[0] for k, v in opt_state.shaped.items()}
        steps = counts_like(opt_state.steps, p_leaves, spec)
        count = int(opt_state.count)
        hs = [_at(h, count, check) for h in hypers]
        if info is not None:
            info.lrs.append(float(schedule_lr(count)))
        scale = 1.0 if info is None else info.scale
        live = None if info is None else info.live
        group = _group(params) if isinstance(params, Params) else None  # (None is also the default group)
        for i, placed in enumerate(owners.of(params, p_leaves)):
            if g_leaves[i] is None:
                continue
            got = (True,) * steps[i].numel() if live is None or steps[i].dim() == 0 else live[i]
            todo = [p for p in placed if got[p.index if steps[i].dim() else 0]]
            if not todo:
                continue
            _check_whole(rule, params, i, p_leaves[i])
            counts = steps[i].tolist() if steps[i].dim() else [int(steps[i])]
            _update_unit(rule, todo, p_leaves[i], g_leaves[i], [shaped[k][i] for k in rule.shaped], counts,
                         opt_state.slots, hs, labels, scale, group, steps[i].dim() > 0,
                         _held_at(opt_state.shaped, params, i))
            for p in todo:
                if steps[i].dim():
                    steps[i][p.index] += 1
                else:
                    steps[i].add_(1)
        if lowp_params is not None:
            lows, _ = tree_flatten(lowp_params)
            for lo, p, g in zip(lows, p_leaves, g_leaves):
                if g is not None:
                    lo.copy_(p)
        return params, WholeState(opt_state.count + 1, opt_state.steps, opt_state.shaped, opt_state.slots)

    init.restrict = lambda chosen: optimizer(rule, hyper, check, groups, chosen)  # zf.optim.multi's hook
    # the parameters it updates whole and their costs (``whole_params``)
    init.whole = WholeParams(select or _every, lambda name, shape: rule.cost(shape))
    return Optimizer(init, update, fuses=True, lr=schedule_lr)


def _every(name: str) -> bool:
    return True


class WholeParams:
    """Which parameters an optimizer updates whole (called with a name) and what each one's update
    costs (``cost(name, shape)``), which the owner layout balances over the ranks (zfunc.tree)."""

    def __init__(self, chosen: Callable[[str], bool], cost: Callable[[str, tuple[int, ...]], float]):
        self.chosen, self._cost = chosen, cost

    def __call__(self, name: str) -> bool:
        return bool(self.chosen(name))

    def cost(self, name: str, shape: tuple[int, ...]) -> float:
        return float(self._cost(name, tuple(shape)))


def whole_params(optimizer) -> Callable[[str], bool] | None:
    """Which parameters ``optimizer`` updates whole (a predicate on names, with ``cost(name, shape)``:
    ``WholeParams``), or None: the step lays each unit out so that each such parameter lies inside
    one shard, its owner's, with the ranks' costs balanced (zfunc.tree's owner layout). ``chain`` and
    ``zf.optim.multi`` pass on their members' (the ``init.whole`` each carries)."""
    return getattr(getattr(optimizer, "init", None), "whole", None)


def _held_at(shaped: dict, params, i: int):
    """For a shaped state held for the selected parameters only (zfunc.optim.held): ``(spec, unit, lo)``,
    where ``lo`` is where the parameters' leaf starts in the unit; else None."""
    node = next(iter(shaped.values()), None)
    if not is_held(node):
        return None
    check_held(node, "the shaped state", params)
    return node.spec, i, params.leaf_start(i)


def _update_unit(rule, todo: list[Placed], p_leaf, g_leaf, s_leaves, counts, slots, hs, labels, scale, group,
                 per_param: bool, held=None) -> None:
    """Update ``todo``'s parameters of one leaf: locally where this rank holds them whole, else by
    gathering the unit to their owners (module docstring). ``held``: ``_held_at``'s, for shaped state
    held for the selected parameters only."""
    dtype = _master_dtype(p_leaf.dtype)
    p_flat, g_flat = p_leaf.view(-1), g_leaf.view(-1)
    s_flat = [s.view(-1) for s in s_leaves]
    s_at = None
    if held is not None:
        spec, unit, lo = held
        s_at = lambda start: held_count(spec, unit, lo, start)  # noqa: E731
    if todo[0].owner == -1:  # the whole buffer, which every rank updates alike (no ZeRO)
        _run(rule, todo, p_flat, g_flat, s_flat, counts, slots, hs, labels, scale, 0, dtype, per_param, s_at)
        return
    if not any(p.cut for p in todo):  # each in one rank's shard: its owner's
        r = dist.rank(group)
        mine = [p for p in todo if p.owner == r]
        _run(rule, mine, p_flat, g_flat, s_flat, counts, slots, hs, labels, scale, r * p_flat.numel(), dtype, per_param,
             s_at)
        _share_slots(todo, slots, group, dtype, p_flat.device)
        return
    if held is not None:  # the fallback gathers the state laid out like the parameters: expanded for it
        spec, unit, lo = held
        full = [expand_held(spec, unit, s, lo, p_flat.numel()) for s in s_flat]
        _update_unit(rule, todo, p_leaf, g_leaf, full, counts, slots, hs, labels, scale, group, per_param)
        for s, f in zip(s_flat, full):
            compact_held(spec, unit, f, lo, out=s)
        return
    r, w, n = dist.rank(group), dist.world_size(group), p_flat.numel()
    pack = torch.empty(2 + len(s_flat), n, dtype=dtype, device=p_flat.device)
    for row, t in zip(pack, (g_flat, p_flat, *s_flat)):
        row.copy_(t)
    full = dist.all_gather(pack.view(-1), group).view(w, 2 + len(s_flat), n).transpose(0, 1).reshape(2 + len(s_flat), w * n)
    mine = [p for p in todo if p.owner == r]
    _run(rule, mine, full[1], full[0], list(full[2:]), counts, slots, hs, labels, scale, 0, dtype, per_param)
    out = torch.zeros(1 + len(s_flat), w * n, dtype=dtype, device=p_flat.device)
    for p in mine:
        out[:, p.start : p.stop] = full[1:, p.start : p.stop]
    dist.all_reduce_sum(out, group)
    lo, hi = r * n, (r + 1) * n
    for p in todo:
        a, b = max(p.start, lo), min(p.stop, hi)
        if a < b:
            for dst, src in zip((p_flat, *s_flat), out):
                dst[a - lo : b - lo].copy_(src[a:b])
    _share_slots(todo, slots, group, dtype, p_flat.device)


def _share_slots(todo: list[Placed], slots, group, dtype, device) -> None:
    """Every rank keeps every parameter's slots (small: Adafactor's factors, torch's ``step``), so
    checkpoints and another world size read them anywhere: after an update, one all-reduce of the
    owners' new slots (the others add zeros)."""
    if dist.world_size(group) == 1:
        return
    parts = [(p, k) for p in todo for k in sorted(slots.get(p.name, {}))]
    if not parts:
        return
    r = dist.rank(group)
    sizes = [slots[p.name][k].numel() for p, k in parts]
    pack = torch.zeros(sum(sizes), dtype=dtype, device=device)
    for (p, k), piece in zip(parts, pack.split(sizes)):
        if p.owner == r:
            piece.copy_(slots[p.name][k].reshape(-1))
    dist.all_reduce_sum(pack, group)
    for (p, k), piece in zip(parts, pack.split(sizes)):
        if p.owner != r:
            slots[p.name][k].copy_(piece.view(slots[p.name][k].shape))


def _run(rule, mine: list[Placed], p_flat, g_flat, s_flat, counts, slots, hs, labels, scale, base, dtype,
         per_param, s_at=None) -> None:
    """``rule.update`` over ``mine``, whose elements lie at ``start - base`` of the flat tensors given,
    one call per group; a parameter stored in a narrower dtype is updated in a copy and written back."""
    by_label: dict[int, list[Item]] = {}
    back = []
    for p in mine:
        a, b = p.start - base, p.stop - base
        param = p_flat[a:b].view(p.shape)
        if param.dtype != dtype:
            back.append((param, param := param.to(dtype)))
        grad = g_flat[a:b].view(p.shape).to(dtype, copy=True)
        if scale != 1.0:
            grad.mul_(scale)
        c = a if s_at is None else s_at(p.start)  # where it lies in the shaped state (held: zfunc.optim.held)
        state = {k: s[c : c + b - a].view(p.shape) for k, s in zip(rule.shaped, s_flat)}
        own = slots.setdefault(p.name, {})
        state.update(own)
        item = Item(p.name, param, grad, state, counts[p.index] if per_param else counts[0])
        by_label.setdefault(labels.of(p.name), []).append(item)
    for label, items in by_label.items():
        rule.update(items, hs[label])
        for item in items:
            kept = slots[item.name]
            for k, v in item.state.items():
                if k in rule.shaped or kept.get(k) is v:
                    continue
                if k in kept and kept[k].shape == v.shape:
                    kept[k].copy_(v)  # the tensor the state (and every rank's pack) already holds
                else:
                    kept[k] = v
    for narrow, wide in back:
        narrow.copy_(wide)


class _Owners:
    """Each leaf's whole parameters and their owners, worked out once per layout."""

    def __init__(self, rule: Rule, select):
        self.rule, self.select = rule, select
        self._cache: dict = {}

    def of(self, params, leaves) -> list[list[Placed]]:
        """Per leaf, its whole parameters (from the layout alone: a leaf may be an empty stand-in, as
        offload_nvme's init hands one unit at a time)."""
        if not isinstance(params, Params):
            names = leaf_names(params)
            units = [[(0, n, tuple(t.shape), 0, t.numel())] if self._chosen(n) else [] for n, t in zip(names, leaves)]
            return assign(units, [None] * len(units), 1, self.rule.cost)
        spec = params.spec
        group = _group(params)
        w = dist.world_size(group)
        key = (id(spec.model), spec.sharded, spec.group, spec.frozen)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is spec.model:
            return hit[1]
        units, shards = [], []
        for i in range(len(spec.sharded)):
            seg = spec.segment(i)
            units.append([(k, e.name, e.shape, e.offset, e.offset + e.numel) for k, e in enumerate(seg.entries)
                          if e.numel and self._chosen(spec.model.canonical_name(e.name))])
            shards.append(seg.padded // w if spec.sharded[i] else None)
        placed = assign(units, shards, w, self.rule.cost)
        self._cache[key] = (spec.model, placed)
        return placed

    def _chosen(self, name: str) -> bool:
        return self.select is None or bool(self.select(name))


def _check_whole(rule, params, i: int, leaf) -> None:
    """A leaf is the unit's whole home part (its shard, or all of it), not a piece of it: offload_nvme
    with a ``sub_group_size`` or ``buffer_size`` below a unit's shard hands the update pieces, and a
    whole-tensor update needs each parameter whole (refused, naming both knobs and the size to give)."""
    if not isinstance(params, Params):
        return
    spec = params.spec
    w = dist.world_size(_group(params))

    def home(k):
        seg = spec.segment(k)
        return seg.padded // w if spec.sharded[k] else seg.padded

    if leaf.numel() != home(i):
        largest = max(home(k) for k in range(len(spec.sharded)))
        raise NotImplementedError(
            f"{rule.name}: unit {spec.model.units[i].name or '<root>'!r} is updated a piece at a time "
            f"({leaf.numel()} of its {home(i)} elements: offload_nvme's sub_group_size or buffer_size is smaller "
            f"than its shard), but a whole-tensor optimizer needs each parameter whole, so each unit's shard at "
            f"once: give offload_nvme sub_group_size >= {largest} and buffer_size >= {largest} (elements: the "
            "largest unit's shard), or use offload_cpu")


def _group(params: Params):
    return params.spec.process_group


def _at(h: dict, count: int, check) -> dict:
    now = at(h, count)
    if now != h:
        check(now)
    return now


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _zeros_master(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=_master_dtype(p.dtype))


def _grads_like(grads, params) -> list[torch.Tensor | None]:
    leaves, tspec = optree.tree_flatten(grads, none_is_leaf=True, namespace=NAMESPACE)
    pspec = optree.tree_structure(params, none_is_leaf=True, namespace=NAMESPACE)
    if tspec != pspec:
        raise ValueError(f"grads does not have the structure of params:\n  grads: {tspec}\n  params: {pspec}")
    return leaves

