"""``zf.bind``: the model run on a state's current weights between steps, for generation and
evaluation (and ``engine.module``): a step's forward machinery (zfunc.grad's ``ParamView``) with
no gradients, no coordinator, and the state left as it was."""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from .. import compiled, lazy
from ..grad import ParamView, cast_inputs
from ..materialize import Materializer, Tracker
from ..state import State, check_usable


@contextlib.contextmanager
def bind(state, model: nn.Module):
    """``with zf.bind(state, model) as m:`` ``m`` is ``model`` running on ``state``'s current weights.

    Inside the block ``model(x)``, ``model.generate(...)`` (Hugging Face) and evaluation loops
    run as a step's forward does: each unit materialized (gathered, read in from host memory or
    disk) as the forward reaches it and released after, so at ZeRO-3 only a unit or two is ever
    whole. Every rank of the state's group runs the same calls (as every rank runs a step). The
    block runs without gradients (train through a step), on copies of the state's buffers, and
    outside the step's coordinator (no prefetch, nothing recorded): the state, and the training
    that follows, are as if the block had not run. Floating-point inputs of the model's forward
    take the compute dtype under mixed precision, as in ``zf.apply``. Outside the block the model
    refuses use again.
    """
    if not isinstance(state, State):
        raise TypeError(f"zf.bind(state, model) takes the State step.init returned, got {type(state).__name__}"
                        " (an Engine's model on its weights is engine.module)")
    params, frozen = state.params, state.frozen
    spec = params.spec.model
    check_usable(state, collective=any(params.spec.sharded) or any(frozen.spec.sharded))
    tracker = Tracker()  # tracker.run stays None: the coordinator neither prefetches nor records
    trainable = Materializer(params, tracker)
    frozen_units = Materializer(frozen, tracker, kind="f")
    buffers = {name: b.clone() for name, b in state.buffers.items()}
    view = ParamView(spec, trainable, frozen_units, buffers)
    undo: list[Callable[[], None]] = []
    try:
        undo += view.hook_units(model)[1]  # checks the model; the root unit resolves through its stand-ins
        undo.append(_swap_buffers(model, buffers))
        undo.append(_root_scope(model, view))
        with torch.no_grad(), lazy.resolving(view):
            yield model
    finally:
        for step_back in reversed(undo):
            step_back()
        view.close()
        view.restore_models()
        tracker.close()


def is_own_method(model: nn.Module, name: str, value) -> bool:
    """Whether ``value`` (``model.<name>``) is a method of the model's own class that may compute
    with its weights, not ``nn.Module``'s (``eval()``, ``parameters()``) nor a plain attribute."""
    return not hasattr(nn.Module, name) and callable(value) and getattr(value, "__self__", None) is model


class Bound:
    """A model whose calls each run inside ``bind(state(), model)`` (``engine.module``, as
    DeepSpeed's): ``bound(x)``, ``bound.generate(...)`` and the model's other methods run on the
    weights the state holds at the call; ``nn.Module``'s own methods (``eval()``,
    ``parameters()``, ...) and attributes (``config``) are the model's."""

    def __init__(self, state: Callable[[], Any], model: nn.Module):
        self._state, self._model = state, model

    def __call__(self, *args, **kwargs):
        with bind(self._state(), self._model) as model:
            return model(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self._model, name)
        if not is_own_method(self._model, name, value):
            return value

        def bound(*args, **kwargs):
            with bind(self._state(), self._model):
                return value(*args, **kwargs)
        return bound

    def __repr__(self) -> str:
        return f"Bound({self._model!r})"


def _swap_buffers(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> Callable[[], None]:
    """Put ``buffers`` (the state's, copied) in ``model``'s buffer slots; returns what puts the model's back."""
    old = []
    for name, value in buffers.items():
        path, _, attr = name.rpartition(".")
        module = compiled.owner(model, path)
        old.append((module, attr, module._buffers[attr]))
        module._buffers[attr] = value

    def restore():
        for module, attr, b in old:
            module._buffers[attr] = b
    return restore


def _root_scope(model: nn.Module, view: ParamView) -> Callable[[], None]:
    """Each call of the model's forward: one scope for the root unit's weights it reads (released
    when it returns), and its floating-point inputs in the compute dtype under mixed precision."""

    def enter(module, args, kwargs):
        view.open_scope()
        if view.input_dtype is not None:
            return cast_inputs(view.input_dtype, args, kwargs)
        return None

    pre = model.register_forward_pre_hook(enter, with_kwargs=True)
    post = model.register_forward_hook(lambda *_: view.close_scope(), always_call=True)
    return lambda: (pre.remove(), post.remove())
