"""Composing optimizers from parts: ``chain``, and the gradient transformation it most often
puts before an optimizer, ``clip_by_global_norm``.

:func:`chain` composes any number of GradientTransformations, optionally
followed by one Optimizer; the result is an Optimizer if the last element is
one::

    opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay(0.0, 3e-4, 100, 10_000)))
    opt_state = opt.init(params)
    params, opt_state = opt.update(grads, opt_state, params)

A chain's state is the tuple of its members'. Both take a step's ``info`` (zfunc.optim.base), so
a clip only folds its factor into the step's scale instead of a pass over the gradients.
"""
from __future__ import annotations

import torch

from .base import EmptyState, GradInfo, GradientTransformation, Optimizer, apply_update, realize, scale_
from ..pytree import global_norm, tree_flatten


def chain(*transforms: GradientTransformation | Optimizer) -> GradientTransformation | Optimizer:
    """Compose transformations left to right; state is the tuple of their states.

    ``chain(t1, ..., tn)`` is a GradientTransformation when every ``ti`` is one,
    and an Optimizer when ``tn`` is an Optimizer (``t1..tn-1`` transform the
    gradients, ``tn`` applies them). An Optimizer anywhere else is an error.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, (GradientTransformation, Optimizer)):
            raise TypeError(
                f"chain() argument {i} is {type(t).__name__}, not a GradientTransformation "
                "or Optimizer; build it with zfunc.optim (e.g. clip_by_global_norm, adamw)."
            )
        if isinstance(t, Optimizer) and i != len(transforms) - 1:
            raise TypeError(
                f"chain() argument {i} is an Optimizer (it returns new parameters, not "
                "updates), so it must come last: chain(clip_by_global_norm(1.0), adamw(1e-3))."
            )
    applies = bool(transforms) and isinstance(transforms[-1], Optimizer)
    grad_tx = transforms[:-1] if applies else transforms

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def transform_grads(updates, state, params, info):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state of "
                f"{len(state) if isinstance(state, tuple) else type(state).__name__} "
                "entries; pass the state returned by this chain's init/update."
            )
        new_state = []
        for t, s in zip(grad_tx, state):
            if info is not None and t.fuses:
                updates, s = t.update(updates, s, params, info=info)
            else:
                realize(updates, info)  # a transformation that reads the true values
                updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, new_state

    if applies:
        def update(grads, opt_state, params, *, info=None, lowp_params=None, schedule=None):
            grads, new_state = transform_grads(grads, opt_state, params, info)
            params, last = apply_update(transforms[-1], grads, opt_state[-1], params, info=info,
                                        lowp_params=lowp_params, schedule=schedule)
            return params, (*new_state, last)

        whole = getattr(transforms[-1].init, "whole", None)
        if whole is not None:
            init.whole = whole  # which parameters it updates whole (zfunc.optim.whole.whole_params)
        if getattr(transforms[-1].init, "forward_only", False):
            init.forward_only = True  # it never updates: mixed precision keeps no master copy for it
        if hasattr(transforms[-1].init, "restrict"):  # zf.optim.multi's hook: the optimizer's state for
            # ``chosen``'s parameters only (the transformations before it keep theirs)
            init.restrict = lambda chosen: chain(*transforms[:-1], transforms[-1].init.restrict(chosen))
        return Optimizer(init, update, fuses=True, defers=getattr(transforms[-1], "defers", False),
                         lr=getattr(transforms[-1], "lr", None))

    def update(updates, state, params=None, *, info=None):
        updates, new_state = transform_grads(updates, state, params, info)
        realize(updates, info)  # whoever reads these updates next expects true values
        return updates, tuple(new_state)

    return GradientTransformation(init, update, fuses=True)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` does.

    The norm is :func:`zfunc.pytree.global_norm`, which covers the whole model
    when updates are sharded across ranks. Updates are scaled in place.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, *, info: GradInfo | None = None):
        leaves, _ = tree_flatten(updates)
        if not leaves:
            return updates, state
        if info is not None:  # fold the factor into the step's scale; the norm is known
            info.scale *= min(1.0, max_norm / (info.norm(updates) + 1e-6))
            return updates, state
        scale_(updates, torch.clamp(max_norm / (global_norm(updates) + 1e-6), max=1.0))
        return updates, state

    return GradientTransformation(init, update, fuses=True)
