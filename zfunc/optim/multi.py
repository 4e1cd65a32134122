"""Different optimizers for different parameters in one step: ``zf.optim.multi``, optax's
``multi_transform``.

::

    hidden = lambda name: name.startswith("blocks.") and name.endswith(".weight") and "ln" not in name
    opt = zf.optim.multi({"muon": zf.optim.muon(0.02), "adamw": zf.optim.adamw(3e-4)},
                         lambda name: "muon" if hidden(name) else "adamw")

``param_labels``: a function ``name -> label`` or a mapping from parameter name to label (names as
``model.named_parameters()`` gives them; in a plain pytree, the leaf's path joined with dots). Each
parameter is updated by its label's optimizer only, equal to the torch optimizers side by side, each
over its own parameters. A whole-tensor optimizer (muon, adafactor, ``from_torch``) is made over its
own parameters (it updates, counts and keeps slots for those only); an elementwise one (adamw, adam,
sgd) runs over the flat buffers with the other labels' parameters marked as without gradient
(``GradInfo.live``), so they get no update, no decay and no step count from it. Each member made
through its ``init.restrict`` (adamw, adam, sgd and the whole-tensor ones) keeps its state laid out
like the parameters (AdamW's moments, SGD's and Muon's momentum) for its own parameters only: each
unit's leaf holds just their elements of the parameters' leaf (zfunc.optim.held), which checkpoints
write laid out like the parameters and offload_nvme streams piece by piece; a ``chain`` ending in
one of those restricts its optimizer so (a member without the hook keeps its state over every
parameter, the others' entries zero).

The state is a dict from label to that optimizer's state.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import optree

from .base import GradInfo, Optimizer, apply_update
from .groups import leaf_names
from .whole import WholeParams
from ..pytree import NAMESPACE
from ..tree import Params


def multi(transforms: Mapping[str, Optimizer], param_labels: Callable[[str], str] | Mapping[str, str]) -> Optimizer:
    """Each parameter updated by ``transforms[param_labels(name)]`` (module docstring)."""
    if not transforms:
        raise ValueError("multi: give at least one optimizer, e.g. {'muon': zf.optim.muon(0.02), 'adamw': ...}")
    for label, t in transforms.items():
        if not isinstance(t, Optimizer):
            raise TypeError(f"multi: {label!r} is {type(t).__name__}, not a zfunc Optimizer (zf.optim.adamw(...))")
    if isinstance(param_labels, Mapping):
        table = dict(param_labels)

        def label_of(name):
            if name not in table:
                raise ValueError(f"multi: parameter {name!r} has no label in param_labels; give every parameter one "
                                 f"(labels: {sorted(set(table.values()))})")
            return table[name]
    elif callable(param_labels):
        label_of = param_labels
    else:
        raise TypeError("multi: param_labels must be a function name -> label or a mapping name -> label")

    seen: dict[str, str] = {}

    def labelled(name: str) -> str:
        label = seen.get(name)
        if label is None:
            label = label_of(name)
            if label not in transforms:
                raise ValueError(f"multi: parameter {name!r} is labelled {label!r}, which names no optimizer; "
                                 f"the optimizers: {sorted(transforms)}")
            seen[name] = label
        return label

    def own(label):
        return lambda name: labelled(name) == label

    opts = {label: (t.init.restrict(own(label)) if hasattr(t.init, "restrict") else t)
            for label, t in transforms.items()}
    whole = {label for label, t in transforms.items() if hasattr(t.init, "restrict") and hasattr(t.init, "whole")}

    def init(params):
        for name in _names(params):
            labelled(name)
        return {label: t.init(params) for label, t in opts.items()}

    def update(grads, opt_state, params, *, info: GradInfo | None = None, lowp_params=None):
        base = info if info is not None else GradInfo()
        new = {}
        for label, t in opts.items():
            sub_grads, sub_info = grads, replace(base)  # a copy sharing ``lrs``
            if label not in whole:
                if isinstance(params, Params):
                    sub_info = replace(base, live=_live(params, base.live, own(label)))
                else:
                    sub_grads = _masked(grads, params, own(label))
            if not t.fuses:  # it scales the gradients in place: give it its own
                sub_grads = _clone(sub_grads)
            params, new[label] = apply_update(t, sub_grads, opt_state[label], params, info=sub_info,
                                              lowp_params=lowp_params)
        return params, new

    if whole:  # zfunc.optim.whole.whole_params: each parameter's cost is its own optimizer's
        init.whole = WholeParams(lambda name: labelled(name) in whole,
                                 lambda name, shape: opts[labelled(name)].init.whole.cost(name, shape))
    first = next(iter(transforms.values()))
    return Optimizer(init, update, fuses=True, lr=first.lr)


def _names(params) -> list[str]:
    if isinstance(params, Params):
        model = params.spec.model
        return [model.canonical_name(e.name) for i in range(len(params.spec.sharded)) for e in params.spec.segment(i).entries]
    return leaf_names(params)


def _live(params: Params, live, chosen) -> tuple[tuple[bool, ...], ...]:
    """``live`` with only the parameters ``chosen`` selects left on."""
    spec, out = params.spec, []
    for i in range(len(spec.sharded)):
        entries = spec.segment(i).entries
        got = (True,) * len(entries) if live is None else live[i]
        out.append(tuple(bool(on) and chosen(spec.model.canonical_name(e.name)) for on, e in zip(got, entries)))
    return tuple(out)


def _masked(grads, params, chosen):
    """``grads`` with ``None`` for the leaves ``chosen`` does not select (a plain pytree)."""
    names = leaf_names(params)
    leaves, spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=NAMESPACE)
    return optree.tree_unflatten(spec, [g if g is not None and chosen(n) else None for g, n in zip(leaves, names)])


def _clone(grads):
    leaves, spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=NAMESPACE)
    return optree.tree_unflatten(spec, [None if g is None else g.clone() for g in leaves])
