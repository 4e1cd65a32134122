"""Offload as a step transform: the optimizer's work and state in CPU memory (ZeRO-Offload).

``offload_cpu(step)`` moves what the update needs off the accelerator:

* placement: the optimizer state's home is the CPU (``opt_home``), and so is
  the gradients' (``grad_home``): where the parameters live on an accelerator,
  each unit's reduced gradient is copied to host memory (pinned,
  asynchronously) as its backward finishes (``GradToHost``), so the copies
  overlap the rest of backward; under ``accumulate`` the update copies the
  accumulated sums;
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

from ..grad import grad_spec
from ..optim.optimizers import Optimizer, apply_update
from ..placement import CPU, DEVICE, Placement
from ..pytree import tree_leaves, tree_map
from .sinks import GradOffHome, with_grad_sink
from ..step import Step, expect_step
from ..transform import Transform, check_inside_zero
from ..tree import Params


class GradToHost(GradOffHome):
    """Each unit's reduced gradient is copied to host memory as its backward finishes (on CUDA
    asynchronously, into pinned memory, so the copies overlap the rest of backward; on the CPU
    it is the same tensor)."""

    def __init__(self, spec, pin: bool):
        super().__init__(spec)
        self.pin = pin
        self.grads: dict[int, torch.Tensor] = {}
        self.copied = False

    def _store(self, unit, g: torch.Tensor) -> None:
        host = to_host(g, self.pin) if unit.place.grad_home == CPU else g
        self.copied |= host is not g
        self.grads[unit.index] = host

    def finish(self) -> Params:
        if self.copied and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        return Params(self.spec, [self.grads.get(i) for i in range(len(self.spec.sharded))])


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

    return Optimizer(init, update, fuses=True)


class Offload(Transform):
    family = "offload"

    def __init__(self, pin_memory: bool, copy_grads_on_host: bool = False):
        self.pin_memory = pin_memory
        self.copy_grads_on_host = copy_grads_on_host

    @property
    def name(self) -> str:
        return "offload_cpu"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(offload_cpu(f))")

    def place(self, p: Placement, unit) -> Placement:
        return replace(p, opt_home=CPU, grad_home=CPU)

    def wrap_optimizer(self, optimizer):
        return host_optimizer(optimizer, self._pin)

    def move(self, leaf: torch.Tensor, to: str, device: torch.device | None = None) -> torch.Tensor:
        """To the CPU: a host copy (pinned where CUDA exists); to DEVICE: onto ``device``."""
        if to == CPU:
            return to_host(leaf, self._pin)
        if to == DEVICE and device is not None:
            return leaf.to(device, non_blocking=self._pin)
        return leaf

    @property
    def _pin(self) -> bool:
        return self.pin_memory and torch.cuda.is_available()  # pinning needs a CUDA driver

    def wrap_grad(self, grad_fn):
        def sink(params):
            on_host = all(t is None or t.device.type == "cpu" or p.grad_home != CPU
                          for t, p in zip(params.leaves, params.spec.placements))
            if on_host and not self.copy_grads_on_host:  # nothing to copy: autograd hands them on
                return None
            return GradToHost(grad_spec(params.spec), self._pin)

        return with_grad_sink(grad_fn, sink)


def offload_cpu(step: Step, *, pin_memory: bool = True, copy_grads_on_host: bool = False) -> Step:
    """Keep the optimizer state in CPU memory and update it there (module docstring).

    ``pin_memory``: page-locked host buffers where CUDA exists, so the copies
    run asynchronously. Write it inside the ZeRO stage and outside
    ``mixed_precision``: ``zero3(offload_cpu(mixed_precision(f)))``.
    ``copy_grads_on_host``: where the parameters already live in host memory, still send each
    unit's gradient through the copy-as-backward-finishes path that accelerator parameters take
    (off by default: there is nothing to copy, and that path held about 10% more RSS on the CPU
    benchmark; tests on CPU-only machines turn it on to run that path).
    """
    expect_step(step, "offload_cpu")
    return step.then(Offload(pin_memory, copy_grads_on_host))
