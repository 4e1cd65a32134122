"""offload_cpu(delay=1): ZeRO-Offload's delayed parameter update (DPU), opt-in and defined.

An exact update cannot start before every gradient is agreed, and the next forward needs every
unit early, so the host's update stays mostly serial (docs/gpu.md). Delayed by one step, the
host update of step t runs behind the whole of step t+1's forward and backward, which use the
parameters from before that update; step t+1's gradient is taken at parameters one update old.

What it computes (the reference: tests/harness/delayed_reference.py, a loop over ``torch.optim``).
Each step t, in this order:

1. the gradient g_t at the parameters the forward holds (``state.params``);
2. the agreement: if g_t is non-finite (fp16 overflow) the step is skipped as any step is: the
   loss scale follows g_t, and nothing else changes (the pending update stays pending, g_t is
   never applied);
3. else, if fewer than ``delay_after`` updates have run, the exact update with g_t (the
   parameters the next forward uses include it);
4. else the pending update (the previous update's result, if any) lands in the parameters the
   forward uses, and the update with g_t (clipped by its own norm, unscaled by its own scale, at
   the optimizer's next count) starts; it lands at the next step that updates.

So, with ``delay_after=0``: the forward of step t uses x_{t-2}, where x_k is the parameters after
applying g_1..g_k in order, with the optimizer's moments and counts exactly as ``torch.optim`` has
them after k steps.

Where it lives: the host keeps its own copy of the parameters, ``DelayedState.ahead``, which every
update writes (x_t), while the forward's buffers (``state.params``) keep x_{t-1} until the next
update copies ``ahead`` into them first thing. The forward never waits for the update, and the
next update waits for it (behind the next forward on offload_cpu's worker where ``overlap``;
zfunc.transforms.offload.host_update). ``ahead`` is a part of the state of its own name (saved and
loaded by checkpoints: the pending update survives a resume), as is ``updates`` (how many updates
ran, for ``delay_after``). Under ``mixed_precision`` the fp32 master, like ``ahead``, already holds
the pending update, so ``zf.gather_params`` (which reads the master) is one update ahead of
``state.params``; without it, it reads ``state.params``.

A delayed update that fails behind the next forward marks the parameters it returned with its
``Fault``: the state, and every state after it, refuses every use.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ...optim.base import Optimizer
from ...tree import Params
from .host_sums import to_host


class DelayedState(NamedTuple):
    """The optimizer state under ``offload_cpu(delay=...)``: the host copy of the parameters with
    every update that ran (``ahead``), how many ran (``updates``, a 0-d int64), and offload's own
    state (``inner``: a ``HostState`` whose ``params`` is None: ``ahead`` is its host copy)."""

    ahead: Any
    updates: Any
    inner: Any

    own_parts = ("ahead", "updates")  # parts of their own name (zfunc.state.wrapper_role), not copies of params


def delayed_optimizer(host: Optimizer, host_state_type, pin: bool, delay_after: int, record: dict) -> Optimizer:
    """``host`` (offload_cpu's ``host_optimizer``) with each update after the first ``delay_after``
    landing one update late (module docstring). ``host_state_type``: ``HostState``."""

    def init(params):
        if not isinstance(params, Params):
            raise TypeError("offload_cpu(delay=...) updates a step's Params; write it inside a ZeRO stage: "
                            "zeroN(offload_cpu(f, delay=1))")
        state = host.init(params)
        ahead = state.params if state.params is not None else _fresh_copies(params)
        return DelayedState(ahead, torch.zeros((), dtype=torch.int64), host_state_type(None, state.inner))

    def update(grads, opt_state, params, **kw):
        ahead = opt_state.ahead
        ahead.leaves  # the previous update is over (raises if it failed)
        updates = opt_state.updates + 1
        exact = int(opt_state.updates) < delay_after
        record["delayed"] = not exact
        if exact:  # the host copy updated and copied into the forward's buffers, as without delay
            out, state = host.update(grads, host_state_type(ahead, opt_state.inner.inner), params, **kw)
            return out, DelayedState(state.params, updates, host_state_type(None, state.inner))
        landed = _land(params, ahead, pin)
        down = _device_bytes(grads.leaves_in_flight if isinstance(grads, Params) else [])
        ahead, state = host.update(grads, host_state_type(None, opt_state.inner.inner), ahead, **kw)
        record["pcie_bytes"] = record.get("pcie_bytes", 0) + landed + down  # the roofline's traffic
        fault = getattr(ahead, "fault", None)  # the update behind the next forward: its failure refuses
        out = params if fault is None else params.waiting_for({}, fault)
        return out, DelayedState(ahead, updates, host_state_type(None, state.inner))

    return Optimizer(init, update, fuses=True)


def check_delay(delay, delay_after, params: bool, split: bool) -> None:
    """Refuse a ``delay``/``delay_after`` ``offload_cpu`` cannot run, saying what to write."""
    for name, value in (("delay", delay), ("delay_after", delay_after)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"offload_cpu: {name} must be a whole number >= 0, got {value!r}")
    if delay > 1:
        raise ValueError(f"offload_cpu: delay={delay}: updates can land one step late (delay=1) or at once "
                         "(delay=0), not later")
    if delay and params:
        raise ValueError("offload_cpu(delay=1) keeps a host copy of the parameters apart from the ones the "
                         "forward reads, which params=True makes the same: drop params=True, or delay=")
    if delay and split:
        raise ValueError("offload_cpu(delay=1) delays the host's update; units kept on the device "
                         "(plan=/ratio=/budget=) would update at once: drop those, or delay=")


def _land(params: Params, ahead: Params, pin: bool) -> int:
    """The pending update into the forward's buffers, complete before anything writes ``ahead``;
    the bytes copied to a device."""
    sent = []
    for dst, src in zip(params.leaves, ahead.leaves):
        if dst is not None and src is not None and dst is not src:
            dst.copy_(src, non_blocking=pin and dst.device.type != "cpu")
            sent.append(dst)
    copied = _device_bytes(sent)
    if copied and torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # the update about to start writes ``ahead`` in place
    return copied


def _device_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.device.type != "cpu")


def _fresh_copies(params: Params) -> Params:
    """Host copies of ``params`` (new tensors even where they already live on the CPU) in the dtype
    each unit's placement stores them in: ``Step.init`` runs the optimizer's init before it casts
    the parameters, and the forward's buffers hold the cast."""
    leaves = []
    for t, p in zip(params.leaves, params.spec.placements):
        if t is None:
            leaves.append(None)
            continue
        cast = t if p.param_dtype in (None, t.dtype) else t.to(p.param_dtype)
        host = to_host(cast, False)
        leaves.append(host.clone() if host is t else host)
    return Params(params.spec, leaves)
