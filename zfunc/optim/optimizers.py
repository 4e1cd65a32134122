"""Optimizers as pairs of functions over pytrees of tensors, in the style of optax.

Two protocols, both NamedTuples of ``(init, update)``:

``GradientTransformation``
    transforms gradients: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``, exactly optax's
    protocol. Example: :func:`clip_by_global_norm`.

``Optimizer``
    applies gradients: ``init(params) -> opt_state`` and
    ``update(grads, opt_state, params) -> (params, opt_state)``. Unlike optax it
    returns the *new parameters*, so a fused kernel can update them in place.
    Examples: :func:`adamw`, :func:`adam`, :func:`sgd`. This is what
    ``zf.train_step(loss_fn, optimizer)`` takes.

:func:`chain` composes any number of GradientTransformations, optionally
followed by one Optimizer; the result is an Optimizer if the last element is
one::

    opt = chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay(0.0, 3e-4, 100, 10_000)))
    opt_state = opt.init(params)
    params, opt_state = opt.update(grads, opt_state, params)

Donation. ``update`` consumes its tensor arguments, like ``jax.jit`` with
``donate_argnums``: it may overwrite ``grads``/``updates``, ``opt_state`` and
``params`` in place and returns the results (often the very same tensors).
Callers must use only the returned values. A ZeRO library cannot afford a second
copy of parameters or optimizer state, and a training step owns its gradients.

State is an explicit pytree (a chain's state is the tuple of its members'). The
optimizers' states hold ``count``, a 0-d int64 CPU tensor (updates applied so
far; it stays on CPU wherever the rest of the state goes), ``steps``, the
updates each parameter got (its bias correction; int64 on the CPU: for a zfunc
``Params``, one count per parameter of each unit, the same on every rank; for
other pytrees, one 0-d count per leaf), and trees with the structure of
``params`` in fp32 (fp64 for fp64 params), so sharding, offload and
checkpoints treat them like params. Low-precision params are updated with fp32
math and fp32 moments, and rounded.

A ``None`` gradient leaf means "no gradient": that leaf is not updated, its
moments and its ``steps`` stay as they were, exactly as ``torch.optim``
skips a parameter whose ``.grad`` is None. Within a unit of a ``Params``,
``GradInfo.live`` says the same per parameter.

What a step knows, folded in. A training step calls ``update`` with keywords
``info=GradInfo(scale, sq_norm, live)`` (multiply the gradients by ``scale`` to
get the true ones: loss-scale unscale, 1/micro-batches; ``sq_norm``: their
squared global norm as handed over, already read to check for inf/NaN;
``live``: which parameters of each unit got a gradient on some rank) and, under
mixed precision, ``lowp_params`` (low-precision copies to write the updated
parameters to). zfunc's optimizers and ``chain`` take them (``fuses=True``), so
unscale, the clip factor, the update and the cast are one kernel pass over
the gradients; ``apply_update`` calls any other optimizer plainly, after
scaling the gradients itself.

``lr`` is a float or a schedule ``step -> float``, where ``step`` is the number
of updates applied before the current one (0 for the first update), as
``torch.optim.lr_scheduler.LambdaLR`` counts. The schedules live in
:mod:`zfunc.optim.lr` and are re-exported here (``zf.optim.linear_warmup``).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import optree
import torch

from .lr import (ScalarOrSchedule, Schedule, as_schedule, constant, cosine_decay, linear_schedule, linear_warmup,
                 warmup_cosine_decay, warmup_cosine_lr, warmup_decay_lr, warmup_lr)
from ..ops import adam as fused_adam
from ..pytree import NAMESPACE, format_path, global_norm, tree_flatten, tree_map
from ..tree import Params

PyTree = Any


class GradientTransformation(NamedTuple):
    """optax's protocol: ``update(updates, state, params=None) -> (updates, state)``."""

    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple[PyTree, PyTree]]
    fuses: bool = False  # update takes ``info=`` (see the module docstring)


class Optimizer(NamedTuple):
    """``update(grads, opt_state, params) -> (params, opt_state)``: returns new params."""

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    fuses: bool = False  # update takes ``info=`` and ``lowp_params=`` (see the module docstring)
    defers: bool = False  # update takes ``schedule=`` (see the module docstring)


@dataclass
class GradInfo:
    """What a step knows about the gradients it hands an optimizer (see the module docstring).

    Transformations that take it fold their own factor into ``scale`` (the
    gradients stay as they are) and read ``sq_norm`` instead of the gradients;
    ``sq_norm`` always describes the gradients as handed over, so the true
    global norm is ``sqrt(sq_norm) * scale``.
    """

    scale: float = 1.0
    sq_norm: float | None = None
    # per unit of the step's Params, whether each of its parameters got a gradient on some rank
    # (a unit's gradient holds zeros for the others; they get no update, as torch skips a None .grad);
    # None: every parameter of a unit with a gradient got one
    live: tuple[tuple[bool, ...], ...] | None = None

    def norm(self, updates) -> float:
        """The global norm of the true gradients (``updates`` times ``scale``)."""
        sq = self.sq_norm if self.sq_norm is not None else float(global_norm(updates)) ** 2
        return math.sqrt(sq) * self.scale


def _scale_(tree, scale: float | torch.Tensor) -> None:
    """Multiply every tensor leaf of ``tree`` by ``scale`` (a number or a 0-d tensor), in place."""
    if isinstance(scale, float) and scale == 1.0:
        return
    by_device = defaultdict(list)
    for g in tree_flatten(tree)[0]:
        if g is not None:
            by_device[g.device].append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, scale.to(device) if isinstance(scale, torch.Tensor) else scale)


def _realize(updates, info: GradInfo | None) -> None:
    """Apply ``info``'s pending scale to ``updates`` in place, for code that reads true values."""
    if info is not None:
        _scale_(updates, info.scale)
        info.scale, info.sq_norm = 1.0, None


def apply_update(optimizer: "Optimizer", grads, opt_state, params, *, info: GradInfo | None = None,
                 lowp_params=None, schedule=None):
    """``optimizer.update``, with ``info`` and ``lowp_params`` folded in by the
    optimizer when it takes them, else done here: gradients scaled in place
    first, updated parameters cast into ``lowp_params`` after. ``schedule`` goes to an
    optimizer that ``defers``; any other does its arithmetic now."""
    if getattr(optimizer, "fuses", False):
        kw = {k: v for k, v in (("info", info), ("lowp_params", lowp_params)) if v is not None}
        if schedule is not None and getattr(optimizer, "defers", False):
            kw["schedule"] = schedule
        return optimizer.update(grads, opt_state, params, **kw)
    _realize(grads, info)
    params, opt_state = optimizer.update(grads, opt_state, params)
    if lowp_params is not None:
        tree_map(lambda lo, p: lo.copy_(p), lowp_params, params)
    return params, opt_state


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


class AdamState(NamedTuple):
    count: torch.Tensor  # 0-d int64 on CPU: updates applied so far (the schedule's step)
    mu: PyTree  # first moments, structured like params
    nu: PyTree  # second moments, structured like params
    steps: PyTree  # updates each parameter got (its bias correction): ``_zero_steps``


class SgdState(NamedTuple):
    count: torch.Tensor  # 0-d int64 on CPU: updates applied so far
    momentum: PyTree  # momentum buffers structured like params; None without momentum
    steps: PyTree  # updates each parameter got: ``_zero_steps``


# --------------------------------------------------------------------------- chain


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
                _realize(updates, info)  # a transformation that reads the true values
                updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, new_state

    if applies:
        def update(grads, opt_state, params, *, info=None, lowp_params=None, schedule=None):
            grads, new_state = transform_grads(grads, opt_state, params, info)
            params, last = apply_update(transforms[-1], grads, opt_state[-1], params, info=info,
                                        lowp_params=lowp_params, schedule=schedule)
            return params, (*new_state, last)

        return Optimizer(init, update, fuses=True, defers=getattr(transforms[-1], "defers", False))

    def update(updates, state, params=None, *, info=None):
        updates, new_state = transform_grads(updates, state, params, info)
        _realize(updates, info)  # whoever reads these updates next expects true values
        return updates, tuple(new_state)

    return GradientTransformation(init, update, fuses=True)


# ------------------------------------------------------------------------ clipping


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
        _scale_(updates, torch.clamp(max_norm / (global_norm(updates) + 1e-6), max=1.0))
        return updates, state

    return GradientTransformation(init, update, fuses=True)


# ---------------------------------------------------------------------- optimizers


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> Optimizer:
    """AdamW, the math of ``torch.optim.AdamW``: decay applied to the weights."""
    return _adam("adamw", lr, betas, eps, weight_decay, decoupled=True)


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Optimizer:
    """Adam, the math of ``torch.optim.Adam``: decay added to the gradient (L2)."""
    return _adam("adam", lr, betas, eps, weight_decay, decoupled=False)


def _adam(name, lr, betas, eps, weight_decay, *, decoupled) -> Optimizer:
    schedule_lr = as_schedule(name, lr)
    beta1, beta2 = betas
    for label, b in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name}: {label} must be in [0, 1), got {b}")
    if not eps >= 0.0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")

    def init(params):
        return AdamState(_zero_count(), tree_map(_zeros_master, params), tree_map(_zeros_master, params),
                         _zero_steps(params))

    def update(grads, opt_state, params, *, info: GradInfo | None = None, lowp_params=None, schedule=None):
        p, spec = tree_flatten(params)
        g = _grads_like(grads, p, params)
        mu = _leaves_like(opt_state.mu, "opt_state.mu", p, spec, params)
        nu = _leaves_like(opt_state.nu, "opt_state.nu", p, spec, params)
        steps = _counts_like(opt_state.steps, p, spec)
        lows = None if lowp_params is None else _lowp_like(lowp_params, p, spec)
        lr = float(schedule_lr(int(opt_state.count)))
        scale = 1.0 if info is None else info.scale

        def work(groups):
            # One call per distinct step count (one in all but rare steps): the kernel
            # takes mixed devices and storage (bf16 params with fp32 moments, fp16
            # grads), does the math in fp32, multiplies the gradients by the step's
            # scale as it reads them and writes the low-precision copies.
            for step, parts in groups.items():
                pick = lambda xs: [_part(xs[i], run) for i, run in parts]  # noqa: E731
                fused_adam.adam_update_(
                    pick(p), pick(g), pick(mu), pick(nu), step=step + 1, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, decoupled=decoupled, grad_scale=scale,
                    lowp_params=None if lows is None else pick(lows),
                )

        _run(_live_by_step(params, g, steps, info), work, lows, p, g, schedule)
        return params, AdamState(opt_state.count + 1, opt_state.mu, opt_state.nu, opt_state.steps)

    return Optimizer(init, update, fuses=True, defers=True)


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
) -> Optimizer:
    """SGD with optional (Nesterov) momentum, the math of ``torch.optim.SGD``.

    The first update initialises each momentum buffer to the gradient, as torch does.
    """
    schedule_lr = as_schedule("sgd", lr)
    if not momentum >= 0.0:
        raise ValueError(f"sgd: momentum must be >= 0, got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"sgd: weight_decay must be >= 0, got {weight_decay}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(
            f"sgd: nesterov=True needs momentum > 0 and dampening == 0, got "
            f"momentum={momentum}, dampening={dampening}"
        )

    def init(params):
        bufs = tree_map(_zeros_master, params) if momentum else None
        return SgdState(_zero_count(), bufs, _zero_steps(params))

    def update(grads, opt_state, params, *, info: GradInfo | None = None, lowp_params=None, schedule=None):
        p_all, spec = tree_flatten(params)
        g_all = _grads_like(grads, p_all, params)
        steps = _counts_like(opt_state.steps, p_all, spec)
        lows = None if lowp_params is None else _lowp_like(lowp_params, p_all, spec)
        bufs_all = _leaves_like(opt_state.momentum, "opt_state.momentum", p_all, spec, params) if momentum else None
        lr = float(schedule_lr(int(opt_state.count)))
        scale = 1.0 if info is None else info.scale

        def work(groups):
            for step, parts in groups.items():
                pick = lambda xs: [_part(xs[i], run) for i, run in parts]  # noqa: E731
                p = pick(p_all)
                # Work in the state's dtype (fp32 or wider); low-precision params are
                # updated in that dtype and rounded back.
                master_dtypes = [torch.promote_types(x.dtype, torch.float32) for x in p]
                masters = [x if x.dtype == d else x.to(d) for x, d in zip(p, master_dtypes)]
                d_p = [x if x.dtype == d else x.to(d) for x, d in zip(pick(g_all), master_dtypes)]
                if scale != 1.0:
                    torch._foreach_mul_(d_p, scale)
                if weight_decay:
                    torch._foreach_add_(d_p, masters, alpha=weight_decay)
                if momentum:
                    bufs = pick(bufs_all)
                    if step == 0:
                        torch._foreach_copy_(bufs, d_p)
                    else:
                        torch._foreach_mul_(bufs, momentum)
                        torch._foreach_add_(bufs, d_p, alpha=1.0 - dampening)
                    if nesterov:
                        torch._foreach_add_(d_p, bufs, alpha=momentum)
                    else:
                        d_p = bufs
                torch._foreach_add_(masters, d_p, alpha=-lr)
                for x, m in zip(p, masters):
                    if x is not m:
                        x.copy_(m)
                if lows is not None:
                    torch._foreach_copy_(pick(lows), p)

        _run(_live_by_step(params, g_all, steps, info), work, lows, p_all, g_all, schedule)
        return params, SgdState(opt_state.count + 1, opt_state.momentum, opt_state.steps)

    return Optimizer(init, update, fuses=True, defers=True)


def _zero_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _zero_steps(params) -> PyTree:
    """No updates yet: for a zfunc ``Params``, one count per parameter of each unit (its parameters
    may miss updates apart, and torch counts per parameter), the whole unit's on every rank, even
    where a rank's slice holds none of a parameter, so the counts stay the same everywhere; for
    any other pytree, one 0-d count per leaf."""
    if isinstance(params, Params):
        spec = params.spec
        return Params(spec, [torch.zeros(len(spec.segment(i).entries), dtype=torch.int64)
                             for i in range(len(spec.sharded))])
    return tree_map(lambda p: _zero_count(), params)


def is_count(t: torch.Tensor) -> bool:
    """Whether ``t`` is an optimizer's step count (``steps``, ``count``: int64, small, the same on
    every rank, kept in RAM), not a tensor laid out like the parameters."""
    return not t.is_floating_point()


def _counts_like(steps, p_leaves, spec) -> list[torch.Tensor]:
    leaves, tspec = tree_flatten(steps)
    if tspec != spec:
        raise ValueError(f"opt_state.steps does not have the structure of params:\n  steps: {tspec}\n  params: {spec}")
    return leaves


Part = tuple[int, int] | None  # elements [start, stop) of a leaf; None: all of it


def _live_by_step(params, grads, steps, info: GradInfo | None) -> dict[int, list[tuple[int, Part]]]:
    """What to update, grouped by the updates each part has had (one group in all but rare steps),
    as ``(leaf, part)``; the counts of what is updated advance.

    A leaf without a gradient is left out. A unit's leaf (one count per parameter) is one part when
    every parameter in it got a gradient (``info.live``) and all have had as many updates, as in
    all but rare steps; else each run of neighbouring parameters that did and have is a part of its
    own, and a parameter without a gradient is left out: no decay, no moment update, its count kept,
    as ``torch.optim`` skips a parameter whose ``.grad`` is None. A parameter counts even where this
    rank's slice holds none of it, so every rank keeps the same counts.
    """
    groups: dict[int, list[tuple[int, Part]]] = {}
    live = None if info is None else info.live
    for i, (g, n) in enumerate(zip(grads, steps)):
        if g is None:
            continue
        if n.dim() == 0:  # one count for the whole leaf
            groups.setdefault(int(n), []).append((i, None))
            n.add_(1)
            continue
        got = (True,) * n.numel() if live is None else live[i]
        for count, part in _runs(params.parameter_ranges(i), got, n.tolist()):
            groups.setdefault(count, []).append((i, part))
        n.add_(torch.tensor(got, dtype=torch.int64))
    return groups


def _runs(ranges, got, counts) -> list[tuple[int, Part]]:
    """``(count, part)`` of one unit's leaf: runs of neighbouring parameters in it (``ranges``: each
    parameter's elements in the leaf, empty where it holds none) that got a gradient and have had
    ``count`` updates; the whole leaf (padding too, as zeros stay zeros) when that is one run of all."""
    runs: list[list[int]] = []
    skipped = False
    for (start, stop), on, count in zip(ranges, got, counts):
        if start == stop:
            continue
        if not on:
            skipped = True
        elif runs and runs[-1][0] == count and runs[-1][2] == start:
            runs[-1][2] = stop
        else:
            runs.append([count, start, stop])
    if len(runs) == 1 and not skipped:
        return [(runs[0][0], None)]
    return [(count, (start, stop)) for count, start, stop in runs]


def _run(groups, work, lows, params, grads, schedule) -> None:
    """``work(groups)`` and the casts of ``_cast_the_rest`` now, or (``schedule``: see the module
    docstring) each leaf's share of them handed to ``schedule``: every leaf with a gradient, its
    parts of ``groups`` (none where no parameter of it got one: then only its cast)."""
    if schedule is None:
        work(groups)
        if lows is not None:
            _cast_the_rest(lows, params, grads, groups)
        return
    by_leaf: dict[int, dict[int, list[tuple[int, Part]]]] = {i: {} for i, g in enumerate(grads) if g is not None}
    for step, parts in groups.items():
        for i, part in parts:
            by_leaf[i].setdefault(step, []).append((i, part))

    def leaf(i, own):
        work(own)
        if lows is not None:
            _cast_the_rest(lows, params, grads, own, only=i)

    for i, own in by_leaf.items():
        schedule(i, lambda i=i, own=own: leaf(i, own))


def _cast_the_rest(lows, params, grads, groups, only: int | None = None) -> None:
    """Each low-precision copy of a leaf with a gradient is written whole: where the update wrote
    only parts (or nothing), the whole leaf cast from its parameter (what the rest already holds),
    so a caller may hand over copies it did not read in (offload_nvme's staging buffers).
    ``only``: that leaf's copy alone."""
    whole = {i for parts in groups.values() for i, part in parts if part is None}
    for i, g in enumerate(grads):
        if g is not None and i not in whole and only in (None, i):
            lows[i].copy_(params[i])


def _part(t: torch.Tensor, part: Part) -> torch.Tensor:
    """Elements ``part`` of the flat leaf ``t`` (a view: updating it updates ``t``)."""
    return t if part is None else t[part[0] : part[1]]


def _grads_like(grads, p_leaves, params) -> list[torch.Tensor | None]:
    """Gradient leaves matched to the parameters; ``None`` where a leaf got no gradient."""
    leaves, tspec = optree.tree_flatten(grads, none_is_leaf=True, namespace=NAMESPACE)
    pspec = optree.tree_structure(params, none_is_leaf=True, namespace=NAMESPACE)
    if tspec != pspec:
        raise ValueError(f"grads does not have the structure of params:\n  grads: {tspec}\n  params: {pspec}")
    live = [i for i, g in enumerate(leaves) if g is not None]
    _check_leaves([leaves[i] for i in live], "grads", [p_leaves[i] for i in live], params, live)
    return leaves


def _lowp_like(lowp_params, p_leaves, spec) -> list[torch.Tensor]:
    leaves, lspec = tree_flatten(lowp_params)
    if lspec != spec:
        raise ValueError(f"lowp_params does not have the structure of params:\n  lowp_params: {lspec}\n  params: {spec}")
    for lo, p in zip(leaves, p_leaves):
        if lo.shape != p.shape:
            raise ValueError(f"a low-precision copy has shape {tuple(lo.shape)}, its parameter {tuple(p.shape)}")
    return leaves


def _zeros_master(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))


def _leaves_like(tree, what: str, p_leaves, spec, params) -> list[torch.Tensor]:
    """Leaves of ``tree``, checked to match the parameters leaf for leaf."""
    leaves, tspec = tree_flatten(tree)
    if tspec != spec:
        raise ValueError(
            f"{what} does not have the structure of params:\n  {what}: {tspec}\n  params: {spec}"
        )
    _check_leaves(leaves, what, p_leaves, params, range(len(leaves)))
    return leaves


def _check_leaves(leaves, what, p_leaves, params, positions) -> None:
    for i, x, p in zip(positions, leaves, p_leaves):
        if x.shape != p.shape or x.device != p.device:
            accessors, _, _ = optree.tree_flatten_with_accessor(params, namespace=NAMESPACE)
            raise ValueError(
                f"{format_path(accessors[i], root=what)} has shape {tuple(x.shape)} on {x.device} "
                f"but the parameter has shape {tuple(p.shape)} on {p.device}; they must match."
            )


def state_bytes_per_element(optimizer) -> int:
    """Bytes of optimizer state per parameter element (what its init makes for one element)."""
    if optimizer is None:
        return 0
    state = optimizer.init({"x": torch.zeros(1)})
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(state, namespace=NAMESPACE)
               if isinstance(t, torch.Tensor) and t.dim() == 1)
