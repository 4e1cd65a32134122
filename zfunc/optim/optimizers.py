"""The optimizers: ``adamw``, ``adam`` and ``sgd``, the math of their ``torch.optim`` namesakes,
each an ``Optimizer`` (zfunc.optim.base) that takes a step's ``info`` and ``lowp_params`` and defers.

State is an explicit pytree: ``count`` and ``steps`` (zfunc.optim.counts) and trees with the
structure of ``params`` in fp32 (fp64 for fp64 params), so sharding, offload and checkpoints treat
them like params. Low-precision params are updated with fp32 math and fp32 moments, and rounded.
Adam's ``state_dtype=torch.bfloat16`` keeps its moments in bf16 (DeepSpeedCPUAdam's
``fp32_optimizer_states=False``): each update reads them as fp32, does its math in fp32 (the
parameter moves by the unrounded moments) and stores them rounded to nearest even, so every
placement of the state (device, host, swap files, checkpoints) holds half the bytes.
A ``None`` gradient leaf, or a parameter ``GradInfo.live`` marks without one, is not updated.

``lr`` is a float or a schedule ``step -> float``, where ``step`` is the number
of updates applied before the current one (0 for the first update), as
``torch.optim.lr_scheduler.LambdaLR`` counts. The schedules live in
:mod:`zfunc.optim.lr`. Each update appends the lr it used to ``info.lrs`` (zfunc.optim.base);
the optimizer's ``lr`` field is its schedule.

``groups``: per-parameter hyperparameters, ``torch.optim``'s param groups (zfunc.optim.groups); every
hyperparameter, a group's or the optimizer's own, is a number or a schedule ``step -> value``.
"""
from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .base import GradInfo, Optimizer, PyTree
from .counts import Part, counts_like, live_by_step, zero_count, zero_steps
from .groups import Labels, at, resolve
from .held import HeldParts, check_held, held_zeros, is_held
from .lr import ScalarOrSchedule, as_schedule
from ..ops import adam as fused_adam
from ..pytree import NAMESPACE, format_path, tree_flatten, tree_map
from ..tree import Params


class AdamState(NamedTuple):
    count: torch.Tensor  # 0-d int64 on CPU: updates applied so far (the schedule's step)
    mu: PyTree  # first moments, structured like params
    nu: PyTree  # second moments, structured like params
    steps: PyTree  # updates each parameter got (its bias correction): ``zero_steps``


class SgdState(NamedTuple):
    count: torch.Tensor  # 0-d int64 on CPU: updates applied so far
    momentum: PyTree  # momentum buffers structured like params; None without momentum
    steps: PyTree  # updates each parameter got: ``zero_steps``


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    groups=(),
    state_dtype: torch.dtype = torch.float32,
) -> Optimizer:
    """AdamW, the math of ``torch.optim.AdamW``: decay applied to the weights. ``groups``: the
    parameters that use other values (``zf.optim.group``: ``lr``, ``betas``, ``eps``, ``weight_decay``).
    ``state_dtype``: the moments' storage, ``torch.float32`` (fp64 for fp64 params) or
    ``torch.bfloat16`` (half the state's bytes; math still fp32: the module docstring)."""
    return _adam("adamw", lr, betas, eps, weight_decay, decoupled=True, groups=groups, state_dtype=state_dtype)


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    groups=(),
    state_dtype: torch.dtype = torch.float32,
) -> Optimizer:
    """Adam, the math of ``torch.optim.Adam``: decay added to the gradient (L2). ``groups``: as
    :func:`adamw`'s, and so is ``state_dtype``."""
    return _adam("adam", lr, betas, eps, weight_decay, decoupled=False, groups=groups, state_dtype=state_dtype)


def _adam(name, lr, betas, eps, weight_decay, *, decoupled, groups=(), state_dtype=torch.float32, select=None) -> Optimizer:
    schedule_lr = as_schedule(name, lr)
    zeros = _zeros_state(name, state_dtype)

    def check(h):
        if not callable(h["lr"]):
            as_schedule(name, h["lr"])
        if not isinstance(h["betas"], (tuple, list)) or len(h["betas"]) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {h['betas']!r}")
        for label, b in zip(("betas[0]", "betas[1]"), h["betas"]):
            if not callable(b) and not 0.0 <= b < 1.0:
                raise ValueError(f"{name}: {label} must be in [0, 1), got {b}")
        for key in ("eps", "weight_decay"):
            if not callable(h[key]) and not h[key] >= 0.0:
                raise ValueError(f"{name}: {key} must be >= 0, got {h[key]}")

    hypers = resolve(name, {"lr": lr, "betas": tuple(betas) if isinstance(betas, list) else betas, "eps": eps,
                            "weight_decay": weight_decay}, groups, check)
    labels = Labels(name, groups)

    def init(params):
        labels.check_names(params)
        return AdamState(zero_count(), _state_like(params, zeros, select), _state_like(params, zeros, select),
                         zero_steps(params))

    def update(grads, opt_state, params, *, info: GradInfo | None = None, lowp_params=None, schedule=None):
        p, g, (mu, nu), steps, lows, hs, scale = _begin(
            grads, opt_state, params, info, lowp_params, hypers, check, schedule_lr,
            trees=((opt_state.mu, "opt_state.mu"), (opt_state.nu, "opt_state.nu")))
        held = _held_parts(opt_state.mu, params, p)

        def work(groups):
            # One call per distinct step count and group (one in all but rare steps without
            # groups): the kernel takes mixed devices and storage (bf16 params with fp32
            # moments, fp16 grads), does the math in fp32, multiplies the gradients by the
            # step's scale as it reads them and writes the low-precision copies.
            for (step, label), parts in groups.items():
                h = hs[label]
                pick = lambda xs: [_part(xs[i], run) for i, run in parts]  # noqa: E731
                pick_s = pick if held is None else lambda xs: [_part(xs[i], held.part(i, run)) for i, run in parts]  # noqa: E731
                fused_adam.adam_update_(
                    pick(p), pick(g), pick_s(mu), pick_s(nu), step=step + 1, lr=h["lr"], beta1=h["betas"][0],
                    beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"], decoupled=decoupled,
                    grad_scale=scale, lowp_params=None if lows is None else pick(lows),
                )

        _run(_held_groups(held, labels.split(live_by_step(params, g, steps, info), params)), work, lows, p, g, schedule)
        return params, AdamState(opt_state.count + 1, opt_state.mu, opt_state.nu, opt_state.steps)

    # zf.optim.multi's hook: the state for the parameters ``chosen`` selects only (zfunc.optim.held)
    init.restrict = lambda chosen: _adam(name, lr, betas, eps, weight_decay, decoupled=decoupled, groups=groups,
                                         state_dtype=state_dtype, select=chosen)
    return Optimizer(init, update, fuses=True, defers=True, lr=schedule_lr)


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
    groups=(),
) -> Optimizer:
    """SGD with optional (Nesterov) momentum, the math of ``torch.optim.SGD``.

    The first update initialises each momentum buffer to the gradient, as torch does. ``groups``:
    the parameters that use other values (``zf.optim.group``: ``lr``, ``momentum``,
    ``weight_decay``, ``nesterov``, ``dampening``).
    """
    return _sgd(lr, momentum, weight_decay, nesterov, dampening, groups)


def _sgd(lr, momentum, weight_decay, nesterov, dampening, groups, _select=None) -> Optimizer:
    schedule_lr = as_schedule("sgd", lr)

    def check(h):
        if not callable(h["lr"]):
            as_schedule("sgd", h["lr"])
        for key in ("momentum", "weight_decay"):
            if not callable(h[key]) and not h[key] >= 0.0:
                raise ValueError(f"sgd: {key} must be >= 0, got {h[key]}")
        if h["nesterov"] and not callable(h["momentum"]) and not callable(h["dampening"]) and (
                h["momentum"] <= 0.0 or h["dampening"] != 0.0):
            raise ValueError(
                f"sgd: nesterov=True needs momentum > 0 and dampening == 0, got "
                f"momentum={h['momentum']}, dampening={h['dampening']}"
            )

    hypers = resolve("sgd", {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
                             "dampening": dampening}, groups, check)
    labels = Labels("sgd", groups)
    has_momentum = any(callable(h["momentum"]) or h["momentum"] for h in hypers)

    def init(params):
        labels.check_names(params)
        bufs = _state_like(params, _zeros_master, _select) if has_momentum else None
        return SgdState(zero_count(), bufs, zero_steps(params))

    def update(grads, opt_state, params, *, info: GradInfo | None = None, lowp_params=None, schedule=None):
        p_all, g_all, trees, steps, lows, hs, scale = _begin(
            grads, opt_state, params, info, lowp_params, hypers, check, schedule_lr,
            trees=((opt_state.momentum, "opt_state.momentum"),) if has_momentum else ())
        bufs_all = trees[0] if has_momentum else None
        held = _held_parts(opt_state.momentum, params, p_all)

        def work(groups):
            for (step, label), parts in groups.items():
                h = hs[label]
                momentum, dampening, weight_decay = h["momentum"], h["dampening"], h["weight_decay"]
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
                    bufs = (pick(bufs_all) if held is None
                            else [_part(bufs_all[i], held.part(i, run)) for i, run in parts])
                    if step == 0:
                        torch._foreach_copy_(bufs, d_p)
                    else:
                        torch._foreach_mul_(bufs, momentum)
                        torch._foreach_add_(bufs, d_p, alpha=1.0 - dampening)
                    if h["nesterov"]:
                        torch._foreach_add_(d_p, bufs, alpha=momentum)
                    else:
                        d_p = bufs
                torch._foreach_add_(masters, d_p, alpha=-h["lr"])
                for x, m in zip(p, masters):
                    if x is not m:
                        x.copy_(m)
                if lows is not None:
                    torch._foreach_copy_(pick(lows), p)

        _run(_held_groups(held, labels.split(live_by_step(params, g_all, steps, info), params)), work, lows, p_all,
             g_all, schedule)
        return params, SgdState(opt_state.count + 1, opt_state.momentum, opt_state.steps)

    # zf.optim.multi's hook, as adamw's
    init.restrict = lambda chosen: _sgd(lr, momentum, weight_decay, nesterov, dampening, groups, chosen)
    return Optimizer(init, update, fuses=True, defers=True, lr=schedule_lr)


def _state_like(params, make, select):
    """The state laid out like ``params`` (``make`` per leaf); with ``select`` (zf.optim.multi's member)
    and a zfunc ``Params``, for the parameters it selects only (zfunc.optim.held)."""
    if select is None or not isinstance(params, Params):
        return tree_map(make, params)
    return held_zeros(params, select, make)


def _held_parts(tree, params, p_leaves) -> HeldParts | None:
    return HeldParts(tree.spec, params, p_leaves) if is_held(tree) else None


def _held_groups(held: HeldParts | None, groups: dict) -> dict:
    return groups if held is None else held.groups(groups)


def _begin(grads, opt_state, params, info: GradInfo | None, lowp_params, hypers, check, schedule_lr, *, trees=()):
    """How every update opens, written once: the leaves of the parameters, of ``grads``, of each
    ``(tree, what)`` of ``trees`` (the state's trees laid out like the parameters), of the step
    counts and of ``lowp_params`` (None without), all checked against the parameters; each group's
    hyperparameters at this update, and the gradients' scale. The lr it uses goes to ``info.lrs``."""
    p, spec = tree_flatten(params)
    g = _grads_like(grads, p, params)
    leaves = [_leaves_like(tree, what, p, spec, params) for tree, what in trees]
    steps = counts_like(opt_state.steps, p, spec)
    lows = None if lowp_params is None else _lowp_like(lowp_params, p, spec)
    count = int(opt_state.count)
    hs = _hyper_at(hypers, count, check)
    lr = float(schedule_lr(count))
    if info is not None:
        info.lrs.append(lr)
    return p, g, leaves, steps, lows, hs, 1.0 if info is None else info.scale


def _hyper_at(hypers: list[dict], count: int, check) -> list[dict]:
    """Each group's hyperparameters at update ``count``, its schedules read (and checked)."""
    out = []
    for h in hypers:
        now = at(h, count)
        if now != h:
            check(now)
        out.append(now)
    return out


def _run(groups, work, lows, params, grads, schedule) -> None:
    """``work(groups)`` and the casts of ``_cast_the_rest`` now, or (``schedule``: see
    zfunc.optim.base) each leaf's share of them handed to ``schedule``: every leaf with a gradient, its
    parts of ``groups`` (none where no parameter of it got one: then only its cast)."""
    if schedule is None:
        work(groups)
        if lows is not None:
            _cast_the_rest(lows, params, grads, groups)
        return
    by_leaf: dict[int, dict[tuple[int, int], list[tuple[int, Part]]]] = {i: {} for i, g in enumerate(grads) if g is not None}
    for key, parts in groups.items():  # key: (update count, group)
        for i, part in parts:
            by_leaf[i].setdefault(key, []).append((i, part))

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


STATE_DTYPES = (torch.float32, torch.bfloat16)


def _zeros_state(name: str, state_dtype):
    """Adam's moment maker for ``state_dtype`` (checked here, when the optimizer is made): fp32
    (or the parameter's wider dtype), or bf16 whatever the parameter."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"{name}: state_dtype must be torch.float32 (the default) or torch.bfloat16 (moments stored in bf16, "
            f"math in fp32), got {state_dtype!r}; fp16 moments would underflow the second moment"
        )
    if state_dtype == torch.float32:
        return _zeros_master
    return lambda p: torch.zeros_like(p, dtype=state_dtype)


def _leaves_like(tree, what: str, p_leaves, spec, params) -> list[torch.Tensor]:
    """Leaves of ``tree``, checked to match the parameters leaf for leaf."""
    if is_held(tree):  # some parameters' state only: its leaves are smaller (zfunc.optim.held)
        check_held(tree, what, params)
        return list(tree.leaves)
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
