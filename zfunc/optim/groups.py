"""Per-parameter hyperparameters: ``torch.optim``'s param groups over zfunc's flat buffers.

A model's parameters live in one flat buffer per unit, so an optimizer cannot be handed a list of
tensors per group as ``torch.optim`` is. Instead it is handed :func:`group` values, each a
selection of parameters by name and the hyperparameters they use instead of the optimizer's own
(as optax's ``mask=`` selects by a predicate over the tree)::

    no_decay = lambda name: name.endswith("bias") or "norm" in name
    opt = zf.optim.adamw(3e-4, weight_decay=0.1, groups=[zf.optim.group(no_decay, weight_decay=0.0)])

A parameter's name is the model's (``model.named_parameters()``: a tied parameter by its first
name, ``torch.compile``'s wrapper left out); in a plain pytree, its path joined with dots
(``{"embed": {"weight": w}}``: ``"embed.weight"``). A parameter no group selects uses the
optimizer's own hyperparameters; one that two groups select is an error naming both.

Each hyperparameter (``lr``, ``weight_decay``, each of ``betas``, ...) is a number or a schedule
``step -> value``, read at the optimizer's update count as ``lr`` is (``torch``'s schedulers
change ``lr`` and, for ``OneCycleLR``, the momentum of each group every step).

At each update the parts of each leaf the update touches (zfunc.optim.counts) are split further
where the group changes, and each group's parts go to the kernel in one call with its own values.
The optimizer's state holds nothing per group: checkpoints and sharding are as without groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import optree

from .counts import Part
from ..pytree import NAMESPACE
from ..tree import Params


@dataclass(frozen=True)
class Group:
    """Parameters chosen by ``select`` and the hyperparameters they use (see :func:`group`)."""

    select: Callable[[str], bool] | frozenset[str]
    hyper: tuple[tuple[str, Any], ...]

    def selects(self, name: str) -> bool:
        return name in self.select if isinstance(self.select, frozenset) else bool(self.select(name))

    def describe(self) -> str:
        if isinstance(self.select, frozenset):
            names = sorted(self.select)
            return f"group({names[:3]}{' ...' if len(names) > 3 else ''}, {dict(self.hyper)})"
        return f"group({getattr(self.select, '__name__', 'predicate')}, {dict(self.hyper)})"


def group(select: Callable[[str], bool] | Collection[str], **hyper) -> Group:
    """The parameters ``select`` chooses (a predicate ``name -> bool``, or a collection of names)
    use ``hyper`` (e.g. ``weight_decay=0.0``, ``lr=1e-4``) instead of the optimizer's own values."""
    if isinstance(select, str):
        raise TypeError(f"group: select is the string {select!r}; give a list of parameter names "
                        "([{select!r}]) or a predicate name -> bool")
    if not callable(select):
        if not isinstance(select, Collection) or not all(isinstance(n, str) for n in select):
            raise TypeError(f"group: select must be a predicate name -> bool or a collection of parameter "
                            f"names, got {type(select).__name__}")
        select = frozenset(select)
    if not hyper:
        raise TypeError("group: give at least one hyperparameter to change (e.g. weight_decay=0.0)")
    return Group(select, tuple(sorted(hyper.items())))


def resolve(name: str, defaults: Mapping[str, Any], groups, check: Callable[[dict], None]) -> list[dict]:
    """Each group's hyperparameters, index 0 the optimizer's own (``defaults``), index ``k`` the
    ``k``-th group's over them; ``check`` validates each (numbers now, schedules at each update);
    a key the optimizer lacks is refused naming the optimizer's keys."""
    out = [dict(defaults)]
    for g in groups or ():
        if not isinstance(g, Group):
            raise TypeError(f"{name}: groups must be zf.optim.group(...) values, got {type(g).__name__}")
        for key, _ in g.hyper:
            if key not in defaults:
                raise TypeError(f"{name}: {g.describe()} sets {key!r}, which {name} does not take; "
                                f"its hyperparameters: {', '.join(defaults)}")
        out.append({**defaults, **dict(g.hyper)})
    for h in out:
        check(at(h, None))
    return out


def at(hyper: dict, step: int | None) -> dict:
    """``hyper`` with each schedule read at ``step`` (``None``: the schedules left as they are, so
    only the numbers are checked); a tuple's entries (``betas``) each a number or a schedule."""
    return {k: _value_at(v, step) for k, v in hyper.items()}


def _value_at(v, step: int | None):
    """A module-level function, not a closure: a nested one calling itself is a reference cycle a
    step would leave for the collector every update."""
    if callable(v):
        return v if step is None else float(v(step))
    if isinstance(v, tuple):
        return tuple(_value_at(x, step) for x in v)
    return v


class Labels:
    """Which group each parameter is in (0: none, the optimizer's own values; ``k``: the ``k``-th)."""

    def __init__(self, name: str, groups):
        self.name, self.groups = name, tuple(groups or ())
        self._by_name: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    def of(self, param: str) -> int:
        label = self._by_name.get(param)
        if label is None:
            hits = [k for k, g in enumerate(self.groups, 1) if g.selects(param)]
            if len(hits) > 1:
                a, b = (self.groups[k - 1].describe() for k in hits[:2])
                raise ValueError(f"{self.name}: parameter {param!r} is selected by two groups, {a} and {b}; "
                                 "a parameter belongs to one group (as in torch.optim)")
            label = self._by_name[param] = hits[0] if hits else 0
        return label

    def check_names(self, params) -> None:
        """Every name a group lists is a parameter of the model ``params`` holds (a misspelt name
        would select nothing). Only a model's ``Params`` is checked: a plain pytree may be a probe
        (``state_bytes_per_element`` inits the optimizer on one leaf)."""
        if not self.groups or not isinstance(params, Params):
            return
        model = params.spec.model
        known = {model.canonical_name(n) for n in model.parameter_names}
        for g in self.groups:
            if isinstance(g.select, frozenset):
                missing = sorted(g.select - known)
                aliases = [n for n in missing if model.canonical_name(n) != n]
                if aliases:
                    raise ValueError(f"{self.name}: {g.describe()} names {aliases[0]!r}, which is tied to "
                                     f"{model.canonical_name(aliases[0])!r}; name a tied parameter by its first "
                                     "name, as model.named_parameters() does")
                if missing:
                    raise ValueError(f"{self.name}: {g.describe()} names {missing[:3]}, not parameters of the "
                                     f"model (some are: {sorted(known)[:4]}); name them as model.named_parameters() does")

    def split(self, groups: dict[int, list[tuple[int, Part]]], params) -> dict[tuple[int, int], list[tuple[int, Part]]]:
        """``groups`` (update count -> ``(leaf, part)``, zfunc.optim.counts.live_by_step) keyed by
        ``(count, label)``: each part cut where the group of its parameters changes."""
        if not self.groups:
            return {(step, 0): parts for step, parts in groups.items()}
        is_units = isinstance(params, Params)
        names = None if is_units else leaf_names(params)
        out: dict[tuple[int, int], list[tuple[int, Part]]] = {}
        for step, parts in groups.items():
            for i, part in parts:
                if not is_units:
                    out.setdefault((step, self.of(names[i])), []).append((i, part))
                    continue
                for label, piece in self._cut(params, i, part):
                    out.setdefault((step, label), []).append((i, piece))
        return out

    def _cut(self, params: Params, unit: int, part: Part) -> list[tuple[int, Part]]:
        entries = params.spec.segment(unit).entries
        ranges = params.parameter_ranges(unit)
        lo, hi = (0, params.leaves_in_flight[unit].numel()) if part is None else part
        runs: list[list[int]] = []  # [label, start, stop]
        for e, (start, stop) in zip(entries, ranges):
            start, stop = max(start, lo), min(stop, hi)
            if start >= stop:
                continue
            label = self.of(params.spec.model.canonical_name(e.name))
            if runs and runs[-1][0] == label and runs[-1][2] == start:
                runs[-1][2] = stop
            else:
                runs.append([label, start, stop])
        if part is None and len({r[0] for r in runs}) == 1:
            return [(runs[0][0], None)]  # the whole leaf, padding too, as without groups
        return [(label, (start, stop)) for label, start, stop in runs]


def leaf_names(tree) -> list[str]:
    """Each leaf's path joined with dots, in flattening order (the names of a plain pytree's parameters)."""
    paths, _, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [".".join(str(k) for k in path) for path in paths]
