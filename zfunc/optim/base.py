"""The protocols every optimizer and gradient transformation follows, and ``apply_update``, the
one call a training step makes to update its parameters.

Two protocols, both NamedTuples of ``(init, update)``:

``GradientTransformation``
    transforms gradients: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``, exactly optax's
    protocol. Example: ``clip_by_global_norm`` (zfunc.optim.combine).

``Optimizer``
    applies gradients: ``init(params) -> opt_state`` and
    ``update(grads, opt_state, params) -> (params, opt_state)``. Unlike optax it
    returns the *new parameters*, so a fused kernel can update them in place.
    Examples: ``adamw``, ``adam``, ``sgd`` (zfunc.optim.optimizers). This is what
    ``zf.train_step(loss_fn, optimizer)`` takes.

``chain`` (zfunc.optim.combine) composes them.

Donation. ``update`` consumes its tensor arguments, like ``jax.jit`` with
``donate_argnums``: it may overwrite ``grads``/``updates``, ``opt_state`` and
``params`` in place and returns the results (often the very same tensors).
Callers must use only the returned values. A ZeRO library cannot afford a second
copy of parameters or optimizer state, and a training step owns its gradients.

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

Deferred arithmetic. An optimizer that ``defers`` also takes ``schedule=``, a function
``schedule(i, work)``: it does its bookkeeping (the counts) at once and hands leaf ``i``'s
arithmetic over as ``work``, to be run later (``offload_cpu`` runs each unit's share behind the
next forward: zfunc.transforms.offload.host_update).

The step's learning rate. An optimizer that takes ``info`` appends the lr its update uses to
``info.lrs`` (a list that copies of the info made with ``dataclasses.replace`` share, so a wrapper
that hands each piece of the state its own copy, offload_nvme's, still reports), and an Optimizer
carries its schedule as ``lr`` (``step -> lr``, read at the optimizer's own update count: its
state's ``count``), so the step can say which lr a skipped update would have used
(zfunc.optim.reported_lr).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..pytree import NAMESPACE, global_norm, tree_flatten, tree_map

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
    lr: Callable[[int], float] | None = None  # its lr schedule, step -> lr (None: it does not say)


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


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
    # the lr each optimizer update of the step used, appended by the update (module docstring)
    lrs: list[float] = field(default_factory=list)

    def norm(self, updates) -> float:
        """The global norm of the true gradients (``updates`` times ``scale``)."""
        sq = self.sq_norm if self.sq_norm is not None else float(global_norm(updates)) ** 2
        return math.sqrt(sq) * self.scale


def scale_(tree, scale: float | torch.Tensor) -> None:
    """Multiply every tensor leaf of ``tree`` by ``scale`` (a number or a 0-d tensor), in place."""
    if isinstance(scale, float) and scale == 1.0:
        return
    by_device = defaultdict(list)
    for g in tree_flatten(tree)[0]:
        if g is not None:
            by_device[g.device].append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, scale.to(device) if isinstance(scale, torch.Tensor) else scale)


def realize(updates, info: GradInfo | None) -> None:
    """Apply ``info``'s pending scale to ``updates`` in place, for code that reads true values."""
    if info is not None:
        scale_(updates, info.scale)
        info.scale, info.sq_norm = 1.0, None


def apply_update(optimizer: Optimizer, grads, opt_state, params, *, info: GradInfo | None = None,
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
    realize(grads, info)
    params, opt_state = optimizer.update(grads, opt_state, params)
    if lowp_params is not None:
        tree_map(lambda lo, p: lo.copy_(p), lowp_params, params)
    return params, opt_state


def state_bytes_per_element(optimizer) -> int:
    """Bytes of optimizer state per parameter element (what its init makes for one element)."""
    if optimizer is None:
        return 0
    try:  # one 1 x 1 matrix, which whole-tensor optimizers (Muon: 2-D only) take too
        state = optimizer.init({"x": torch.zeros(1, 1)})
    except ValueError:  # a zf.optim.multi whose labels name every parameter, so not "x": AdamW's moments
        return 8
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(state, namespace=NAMESPACE)
               if isinstance(t, torch.Tensor) and t.is_floating_point())
