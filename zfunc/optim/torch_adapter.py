"""Any ``torch.optim.Optimizer`` class as a zfunc optimizer: ``zf.optim.from_torch(cls, **hyper)``.

Elementwise classes zfunc has fused (``AdamW``, ``Adam``, ``SGD``) become ``zf.optim.adamw``,
``adam``, ``sgd``, which update any slice of a flat buffer. Any other class (RMSprop, Adagrad,
Adafactor, Muon, a third-party one written the same way: ``step()`` over ``param.grad`` and
``self.state[param]``) runs as a whole-tensor optimizer (zfunc.optim.whole): at each update, one
instance of ``cls`` over this rank's owned parameters, each a whole tensor (a view of the flat buffer
where this rank holds it whole), its ``.grad`` the true gradient, its ``state`` the kept one; its
``step()`` is the update. The state tensors with the parameter's shape (RMSprop's ``square_avg``,
Adagrad's ``sum``, Muon's ``momentum_buffer``) are kept laid out like the parameters (sharded,
offloaded and checkpointed as Adam's moments are); the rest (``step``, Adafactor's factors) per
parameter, made when the state is made by one step of ``cls`` on zeros (its keys and shapes), kept on
every rank and written by the owner. At a parameter's first update the class makes its own state, in
``__init__`` (Adagrad) or in ``step()`` (the rest), as it would alone.

``shaped=`` names the state keys with the parameter's shape (default: found by one probe step on a
small tensor); ``cost=``: the update's cost for a shape, which owners balance (default: elements).
"""
from __future__ import annotations

import inspect

import torch

from .base import Optimizer
from .lr import as_schedule
from .optimizers import adam, adamw, sgd
from .owners import numel_cost
from .whole import Item, Rule, optimizer


def _fused(cls, hyper):
    """zfunc's fused optimizer for an elementwise torch class it has, or None."""
    names = {torch.optim.AdamW: adamw, torch.optim.Adam: adam, torch.optim.SGD: sgd}
    make = names.get(cls)
    if make is None or any(hyper.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable")):
        return None
    kept = {k: v for k, v in hyper.items() if k in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening",
                                                     "nesterov")}
    return make(**kept)


def _probe_shaped(cls, hyper) -> tuple[str, ...]:
    """The state keys ``cls`` keeps with the parameter's shape, from one step on 2-D and 1-D probes."""
    keys = None
    for shape in ((3, 2), (4,)):
        p = torch.zeros(shape, requires_grad=False)
        p.grad = torch.full(shape, 0.5)
        try:
            opt = cls([p], **{k: v for k, v in hyper.items() if not callable(v)})
            opt.step()
        except (ValueError, RuntimeError):  # Muon refuses 1-D parameters
            continue
        found = {k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.shape == p.shape}
        keys = found if keys is None else keys & found
    return tuple(sorted(keys or ()))


def from_torch(cls: type, *, shaped: tuple[str, ...] | None = None, cost=None, groups=(), **hyper) -> Optimizer:
    """``cls(params, **hyper)`` (a ``torch.optim.Optimizer`` class) as a zfunc optimizer (module
    docstring). ``lr`` may be a schedule, as may any hyperparameter; ``groups``: ``zf.optim.group``."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"from_torch: give a torch.optim.Optimizer class (torch.optim.RMSprop), got {cls!r}")
    fused = None if groups else _fused(cls, hyper)
    if fused is not None:
        return fused
    if "lr" not in hyper:
        hyper["lr"] = _default_lr(cls)
    keys = _probe_shaped(cls, hyper) if shaped is None else tuple(shaped)
    name = cls.__name__

    def check(h):
        if not callable(h["lr"]):
            as_schedule(name, h["lr"])

    def update(items: list[Item], h: dict) -> None:
        if not items:
            return
        params = [it.param for it in items]
        opt = cls(params, **h)
        for it, p in zip(items, params):
            p.grad = it.grad
            if it.step > 0:  # its kept state; at the first step the class makes its own
                opt.state[p] = it.state
        opt.step()
        for it, p in zip(items, params):
            got = opt.state[p]
            for k in keys:
                if got[k] is not it.state[k]:
                    it.state[k].copy_(got[k])
            for k, v in got.items():
                if k not in keys:
                    it.state[k] = v
            p.grad = None

    def init_slots(param_name, shape, dtype, device) -> dict:
        """The state ``cls`` keeps besides ``keys`` for a parameter of ``shape``: one step on zeros, zeroed."""
        p = torch.zeros(shape, dtype=dtype, device=device)
        p.grad = torch.zeros_like(p)
        opt = cls([p], **{k: v for k, v in hyper.items() if not callable(v)})
        opt.step()
        return {k: torch.zeros_like(v) for k, v in opt.state[p].items() if k not in keys and isinstance(v, torch.Tensor)}

    rule = Rule(name, update, shaped=keys, init_slots=init_slots, cost=cost or numel_cost)
    return optimizer(rule, dict(hyper), check, groups)


def _default_lr(cls) -> float:
    default = inspect.signature(cls.__init__).parameters.get("lr")
    if default is None or default.default is inspect.Parameter.empty:
        raise TypeError(f"from_torch: {cls.__name__} has no default lr; give lr=")
    return float(default.default)
