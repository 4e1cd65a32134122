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

With ``params=True`` (ZeRO-Infinity's ``offload_param: {"device": "cpu"}``, under zero3
only) the parameter shards live in host memory too (``Placement.param_home``): the
optimizer updates them there in place, and materializing a unit copies its shard to the
device, then all-gathers (zfunc.placement), so the coordinator copies ahead of use and
releases after, as it gathers; units under zero3's persistence threshold stay on the device.

On a machine without an accelerator everything already lives on the CPU:
the copies are skipped (the same tensors are used), every other line runs
as it does with one, and the step equals the step without offload (with
``params=True`` the shard's copy before use is a plain copy, so the tier's life runs).

It offloads everything inside it, so it goes outside ``mixed_precision`` and
inside the ZeRO stage: ``zero3(offload_cpu(mixed_precision(f)))``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from ..grad import grad_spec
from ..optim.optimizers import Optimizer, apply_update
from ..placement import CPU, DEVICE, Placement, compute_device
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
        if host is not None:  # the update writes the copy the step stores (bf16 under mixed precision), not init's fp32
            host = _as_stored(params, pin)
        return HostState(host, tree_map(lambda t: to_host(t, pin), inner))

    def update(grads, opt_state, params, **kw):
        on_device = any(g.device.type != "cpu" for g in tree_leaves(grads) if isinstance(g, torch.Tensor))
        grads = tree_map(lambda g: to_host(g, pin), grads)  # a no-op for gradients on the CPU
        if on_device and pin:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed before Adam reads
        if opt_state.params is None and pin:  # host-homed parameters cast at init lost their pinning
            params = tree_map(_pinned, params)
        host = params if opt_state.params is None else opt_state.params
        if kw.get("lowp_params") is not None:
            kw["lowp_params"] = tree_map(lambda t: to_host(t, pin), kw["lowp_params"])
        host, inner = apply_update(optimizer, grads, opt_state.inner, host, **kw)
        if opt_state.params is None:
            return host, HostState(None, inner)
        tree_map(lambda dst, src: dst if dst is src else dst.copy_(src, non_blocking=pin), params, host)
        return params, HostState(host, inner)

    return Optimizer(init, update, fuses=True)


def _as_stored(params, pin: bool):
    """Host copies of ``params`` in the dtype each unit's placement stores them in: ``Step.init``
    runs the optimizer's init before it casts the parameters, so the master starts from the
    model's own values; the host copy the update writes and copies back must match the cast."""
    if not isinstance(params, Params):
        return tree_map(lambda t: to_host(t, pin), params)
    leaves = [None if t is None else to_host(t if p.param_dtype in (None, t.dtype) else t.to(p.param_dtype), pin)
              for t, p in zip(params.leaves, params.spec.placements)]
    return Params(params.spec, leaves)


def _pinned(t):
    """A host tensor in pinned memory (a pinned copy once, then itself); others as they are."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


class _HostHome:
    """``Step.init``'s leaves of units whose parameters live on the CPU, moved there as they
    are made (``Transform.init_home``), so the device never holds more than a unit."""

    key = None  # no swap store

    def __init__(self, pin: bool):
        self.pin = pin

    def keep(self, i: int, unit, place: Placement, leaf: torch.Tensor, frozen: bool) -> torch.Tensor:
        return to_host(leaf, self.pin) if place.param_home == CPU else leaf

    def finish(self) -> None:
        pass


class Offload(Transform):
    family = "offload"

    def __init__(self, pin_memory: bool, copy_grads_on_host: bool = False, params: bool = False):
        self.pin_memory = pin_memory
        self.copy_grads_on_host = copy_grads_on_host
        self.params = params

    @property
    def name(self) -> str:
        return "offload_cpu"

    def describe(self, inner: str) -> str:
        return f"offload_cpu({inner}{', params=True' if self.params else ''})"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(offload_cpu(f))")

    def params_off_device_error(self, stage: int) -> str | None:
        if not self.params:
            return None
        return (f"offload_cpu(params=True) needs zero3: zero{stage} keeps the full parameters on the device of "
                f"every rank; write zero3(offload_cpu(f, params=True)), or zero{stage}(offload_cpu(f)) to "
                "offload the optimizer state only")

    def place(self, p: Placement, unit) -> Placement:
        return replace(p, opt_home=CPU, grad_home=CPU, param_home=CPU if self.params else p.param_home)

    def init_home(self, step, spec, places, group):
        """With ``params=True``: host-homed shards go to (pinned) host memory as they are made."""
        if not self.params:
            return None
        if not any(t.family == "zero" and t.stage == 3 for t in step.transforms):
            raise ValueError("offload_cpu(params=True) needs zero3, which shards the parameters it keeps on the "
                             "host: write zero3(offload_cpu(f, params=True)), or offload_cpu(f) to offload the "
                             "optimizer state only")
        return _HostHome(self._pin)

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
            group = params.spec.process_group  # host-homed parameters get their gradients on the device
            on_host = all(t is None or p.grad_home != CPU or compute_device(p, t, group).type == "cpu"
                          for t, p in zip(params.leaves, params.spec.placements))
            if on_host and not self.copy_grads_on_host:  # nothing to copy: autograd hands them on
                return None
            return GradToHost(grad_spec(params.spec), self._pin)

        return with_grad_sink(grad_fn, sink)


def offload_cpu(step: Step, *, params: bool = False, pin_memory: bool = True,
                copy_grads_on_host: bool = False) -> Step:
    """Keep the optimizer state in CPU memory and update it there (module docstring).

    ``params``: keep zero3's parameter shards in host memory too, copied to the device as
    each unit is materialized (needs zero3: ``zero3(offload_cpu(f, params=True))``).

    ``pin_memory``: page-locked host buffers where CUDA exists, so the copies
    run asynchronously. Write it inside the ZeRO stage and outside
    ``mixed_precision``: ``zero3(offload_cpu(mixed_precision(f)))``.
    ``copy_grads_on_host``: where the parameters already live in host memory, still send each
    unit's gradient through the copy-as-backward-finishes path that accelerator parameters take
    (off by default: there is nothing to copy, and that path held about 10% more RSS on the CPU
    benchmark; tests on CPU-only machines turn it on to run that path).
    """
    expect_step(step, "offload_cpu")
    return step.then(Offload(pin_memory, copy_grads_on_host, bool(params)))
