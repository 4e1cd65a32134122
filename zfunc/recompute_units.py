"""Each unit's module run under non-reentrant activation checkpointing (``zf.recompute``).

Under offload the device holds the units a step gathers and the activations its backward needs;
a large micro-batch is bounded by the activations. ``zf.recompute`` keeps only each unit's inputs
(the unit boundaries) from forward to backward and runs the unit again there, as
``torch.utils.checkpoint.checkpoint(block.forward, x, use_reentrant=False)`` around every block would.

zfunc already runs a user's own checkpointing: the recomputation reads the unit's weights through
its stand-ins, which the step's ``Tracker`` resolves by re-gathering the unit (zfunc.lazy,
zfunc.materialize). This module only makes the step do the wrapping itself: from the first
``zf.apply`` of a step until its backward is over, each chosen unit's module has its ``forward``
replaced by one that calls the original under ``checkpoint`` (for the whole step, so a user's own
checkpoint around the unit recomputes the same nesting of checkpoints as its forward ran). The
unit's own forward hooks (zfunc.grad's gather and release) stay outside the checkpointed call, so
what backward recomputes is the module's arithmetic and nothing of zfunc's.

A block compiled in place (``zf.compile_units``, ``torch.compile(model)``) calls its ``forward``
from its compiled code, so dynamo traces the checkpoint into the block's graph (torch.compile's
activation-checkpointing operator: the recomputation runs inside the compiled backward, whose saved
inputs are the block's input and weights). A new step's wrapper has the same code, which is what
the compiled code's guards look at: nothing is compiled again.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Policy:
    """Which units' modules are recomputed: every unit (``select=None``), the named ones (a list of
    unit names, as ``zf.units`` names them), or those a predicate ``(name, module) -> bool`` picks.
    A unit nested inside a chosen one is recomputed with it, never on its own as well."""

    def __init__(self, select=None):
        if select is not None and not callable(select):
            select = tuple(select)
            if not all(isinstance(s, str) for s in select):
                raise TypeError(f"zf.recompute: units= takes unit names or a predicate (name, module) -> bool, "
                                f"got {list(select)!r}")
        self.select = select

    def chooses(self, name: str, module: nn.Module) -> bool:
        if self.select is None:
            return True
        if callable(self.select):
            return bool(self.select(name, module))
        return name in self.select

    def describe(self) -> str:
        if self.select is None:
            return ""
        if callable(self.select):
            return getattr(self.select, "__name__", "predicate")
        return repr(list(self.select))


def wrap(sites, policy: Policy, done: dict[int, Callable[[], None]]) -> None:
    """Put each chosen unit's module (``sites``: zfunc.grad's ``(name, module, slots)``, the root unit
    excluded) under checkpointing, unless ``done`` (``id(module)`` -> what puts it back) has it
    already; ``done`` gains the others."""
    chosen = [(name, module) for name, module, _ in sites if policy.chooses(name, module)]
    outer = [(name, module) for name, module in chosen
             if not any(name.startswith(other + ".") for other, _ in chosen)]
    for _, module in outer:
        if id(module) not in done:
            done[id(module)] = _checkpointed(module)


def _checkpointed(module: nn.Module) -> Callable[[], None]:
    """``module.forward`` under ``checkpoint(..., use_reentrant=False)`` until the returned call."""
    own = module.__dict__.get("forward")  # a forward the user set on the instance, kept as it is
    inner = module.forward
    module.forward = _wrapper(inner)

    def put_back():
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own

    return put_back


def _wrapper(inner: Callable) -> Callable:
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # no backward to recompute for (an eval step, torch.no_grad)
            return inner(*args, **kwargs)
        fn = functools.partial(inner, **kwargs) if kwargs else inner
        return checkpoint(fn, *args, use_reentrant=False)

    return forward
