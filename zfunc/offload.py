"""Offload as a step transform: the optimizer's work and state in CPU memory (ZeRO-Offload).

``offload_cpu(step)`` moves what the update needs off the accelerator:

* placement: the optimizer state's home is the CPU (``opt_home``), and so is
  the gradients' (``grad_home``): the update copies them to host memory
  (pinned where CUDA exists) before the inner optimizer reads them;
* the update: the inner optimizer (with ``mixed_precision`` inside, its fp32
  master weights too) runs on the CPU over host tensors, so zfunc's fused CPU
  Adam does the work; the updated parameters (in their stored dtype) are
  copied back into the device's buffers. Where the parameters are not on the
  CPU the state keeps a host copy of them (``HostState.params``).

On a machine without an accelerator everything already lives on the CPU:
the copies are skipped (the same tensors are used), every other line runs
as it does with one, and the step equals the step without offload.

It offloads everything inside it, so it goes outside ``mixed_precision`` and
inside the ZeRO stage: ``zero3(offload_cpu(mixed_precision(f)))``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from .optim import Optimizer, apply_update, fusing
from .placement import CPU, Placement
from .pytree import tree_leaves, tree_map
from .step import Step
from .transform import Transform, check_inside_zero


class HostState(NamedTuple):
    """The optimizer state under offload: the host copy of this rank's part of the
    parameters (``None`` when they already live on the CPU) and the inner state."""

    params: Any
    inner: Any


def to_host(t, pin: bool):
    """``t`` in CPU memory (pinned if ``pin``): ``t`` itself if it is already there."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    return out.copy_(t, non_blocking=pin)


def host_optimizer(optimizer: Optimizer, pin: bool) -> Optimizer:
    """``optimizer`` run on the CPU over host copies; updated parameters copied back."""

    def init(params):
        on_host = all(t.device.type == "cpu" for t in tree_leaves(params) if isinstance(t, torch.Tensor))
        host = None if on_host else tree_map(lambda t: to_host(t, pin), params)
        inner = optimizer.init(params if host is None else host)
        return HostState(host, tree_map(lambda t: to_host(t, pin), inner))

    def update(grads, opt_state, params, **kw):
        grads = tree_map(lambda g: to_host(g, pin), grads)  # a no-op for gradients on the CPU
        host = params if opt_state.params is None else opt_state.params
        if kw.get("lowp_params") is not None:
            kw["lowp_params"] = tree_map(lambda t: to_host(t, pin), kw["lowp_params"])
        host, inner = apply_update(optimizer, grads, opt_state.inner, host, **kw)
        if opt_state.params is None:
            return host, HostState(None, inner)
        tree_map(lambda dst, src: dst.copy_(src, non_blocking=pin), params, host)
        return params, HostState(host, inner)

    return Optimizer(init, fusing(update))


class Offload(Transform):
    family = "offload"

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory

    @property
    def name(self) -> str:
        return "offload_cpu"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(offload_cpu(f))")

    def place(self, p: Placement, unit) -> Placement:
        return replace(p, opt_home=CPU, grad_home=CPU)

    def wrap_optimizer(self, optimizer):
        # pinned host memory needs a CUDA driver; without one, plain host memory
        return host_optimizer(optimizer, self.pin_memory and torch.cuda.is_available())


def offload_cpu(step: Step, *, pin_memory: bool = True) -> Step:
    """Keep the optimizer state in CPU memory and update it there (module docstring).

    ``pin_memory``: page-locked host buffers where CUDA exists, so the copies
    run asynchronously. Write it inside the ZeRO stage and outside
    ``mixed_precision``: ``zero3(offload_cpu(mixed_precision(f)))``.
    """
    if not isinstance(step, Step):
        raise TypeError(f"offload_cpu transforms a zfunc Step (zf.train_step or zf.eval_step), got {type(step).__name__}")
    return step.then(Offload(pin_memory))
