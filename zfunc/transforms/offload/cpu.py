"""Offload as a step transform: the optimizer's work and state in CPU memory (ZeRO-Offload).

``offload_cpu(step)`` moves what the update needs off the accelerator:

* placement: the optimizer state's home is the CPU (``opt_home``), and so is
  the gradients' (``grad_home``): where the parameters live on an accelerator,
  each unit's reduced gradient is copied to host memory (pinned,
  asynchronously) as its backward finishes (``GradToHost``), so the copies
  overlap the rest of backward; under ``accumulate`` the sums come home in the
  last backward, or live in host memory throughout (``sum_home``: zfunc.transforms.offload.host_sums);
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

import time
from dataclasses import replace
from typing import Any, NamedTuple, Sequence

import optree
import torch

from ... import dist
from ...grad import grad_spec
from .plan import (OffloadPlan, as_plan, check_host_memory, host_state_bytes, once_per_spec, plan_for_budget,
    plan_for_ratio, rank_units, roofline, whole)
from .rates import Rates
from .rates import measure as measure_rates
from ...optim.base import Optimizer, apply_update, state_bytes_per_element
from ...placement import CPU, DEVICE, Placement, compute_device
from ...pytree import NAMESPACE, tree_leaves, tree_map
from .delayed import check_delay, delayed_optimizer
from .cores import resolve as resolve_cores
from .host_update import UnitUpdates, Uploads
from ..sinks import GradOffHome, with_grad_sink
from .host_sums import HostSums, side_copies, to_host
from ...step import Step, expect_step
from ...transform import Transform, check_inside_zero
from ...tree import Params


class GradToHost(GradOffHome):
    """Each unit's reduced gradient is copied to host memory as its backward finishes (on CUDA
    into pinned memory on a side stream, so the copies overlap the rest of backward:
    ``SideCopies``; on the CPU it is the same tensor)."""

    def __init__(self, spec, pin: bool):
        super().__init__(spec)
        self.pin = pin
        self.grads: dict[int, torch.Tensor] = {}
        self.side = side_copies(pin)  # on CUDA the copies run on a stream of their own

    def _store(self, unit, g: torch.Tensor) -> None:
        self.take_home(unit.index, g)

    def take_home(self, index: int, g: torch.Tensor) -> None:
        """Unit ``index``'s reduced gradient, copied home: from backward (``_store``) or from zf.jit's
        program, which reduced it itself (zfunc.traced hands a sink each gradient this way)."""
        if self.spec.placements[index].grad_home != CPU:
            host = g
        elif self.side is not None and g.device.type == "cuda":
            host = self.side.copy(g)
        else:
            host = to_host(g, self.pin)
        self.grads[index] = host

    def finish(self) -> Params:
        if self.side is not None:
            self.side.wait()  # the non-blocking copies have landed
        return Params(self.spec, [self.grads.get(i) for i in range(len(self.spec.sharded))])


class HostState(NamedTuple):
    """The optimizer state under offload: the host copy of this rank's part of the
    parameters (``None`` when they already live on the CPU) and the inner state."""

    params: Any
    inner: Any


def host_optimizer(optimizer: Optimizer, pin: bool, record: dict | None = None,
                   overlap: UnitUpdates | None = None, overlap_on_cpu: bool = True) -> Optimizer:
    """``optimizer`` run on the CPU over host copies; updated parameters copied back.

    Per unit of a ``Params``: a unit whose placement keeps its optimizer state on the device (an
    ``OffloadPlan``'s ``device_units``) is updated there, in the same call (the fused Adam sends
    each tensor to its device's kernel). ``record`` (if given) gets the update's times, the
    parameters updated on the host and the bytes copied, for the step's roofline. ``overlap``
    (an optimizer that ``defers``, over a ``Params``): the host units' arithmetic and uploads
    run on its worker, unit by unit, and the update returns at once (zfunc.transforms.offload.host_update);
    ``overlap_on_cpu`` False: only for a state that computes on CUDA (the default, where nothing
    would run beside the worker but the same cores)."""

    def init(params):
        homes = _host_units(params)
        copies = [h and t is not None and _off_cpu(t) for h, t in zip(homes, _leaves(params))]
        if not any(copies):  # the update runs where each unit's parameters live
            return HostState(None, optimizer.init(params))
        inner = optimizer.init(_by_unit(params, copies, lambda t: to_host(t, pin)))
        # the update writes the copy the step stores (bf16 under mixed precision), not init's fp32
        return HostState(_as_stored(params, copies, pin), inner)

    def update(grads, opt_state, params, **kw):
        if overlap is not None:
            overlap.drain()  # the previous update is over before this one reads its state
        started = time.perf_counter()
        homes = _host_units(params)
        moved = [g for h, g in zip(homes, _leaves(grads)) if h and g is not None and _off_cpu(g)]
        grads = _by_unit(grads, homes, lambda g: to_host(g, pin))  # a no-op for gradients on the CPU
        if moved and pin:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed before Adam reads
        if opt_state.params is None:
            work = _by_unit(params, homes, _pinned) if pin else params  # host-homed ones cast at init lost pinning
        else:
            work = _with_host_copies(params, opt_state.params)
        if kw.get("lowp_params") is not None:
            kw["lowp_params"] = _by_unit(kw["lowp_params"], homes, lambda t: to_host(t, pin))
        works: dict[int, list] = {}
        deferring = (overlap is not None and isinstance(params, Params) and None not in params.leaves
                     and (overlap_on_cpu or dist.compute_device(params.spec.process_group).type == "cuda"))
        if deferring:
            kw["schedule"] = lambda i, w: works.setdefault(i, []).append(w)
        work, inner = apply_update(optimizer, grads, opt_state.inner, work, **kw)
        host, back, back_srcs, sent_down = None, [], [], []
        if opt_state.params is not None:
            back = [(i, dst, src) for i, (dst, src, h) in enumerate(zip(_leaves(params), _leaves(work), _leaves(opt_state.params)))
                    if h is not None]
            back_srcs = [src for _, _, src in back]  # up; down: the gradients of the same units
            sent_down = [g for g, h in zip(_leaves(grads), _leaves(opt_state.params)) if h is not None and g is not None]
            host = _with_host_copies(opt_state.params, work, only_where_set=True)
            work_out = params
        else:
            work_out = work
        if works:  # the host units' arithmetic and uploads on the worker, in forward order
            for i in [i for i in works if not homes[i]]:  # device units: their kernels queued now
                for w in works.pop(i):
                    w()
            ups = _uploads(pin)
            copy_back = {i: (dst, src) for i, dst, src in back}
            done = overlap.start(sorted(works), works, lambda i: _copy_back(ups, *copy_back[i]) if i in copy_back
                                 else None, ups, [u.name for u in params.spec.model.units])
            work_out, host, inner = (_pending(t, done) for t in (work_out, host, inner))
        else:
            for _, dst, src in back:
                tree_map(lambda d, s: d if d is s else d.copy_(s, non_blocking=pin), dst, src)
        if record is not None:
            on_host = [t for h, t in zip(homes, _leaves(work)) if h and t is not None]
            record.update(started=started, ended=time.perf_counter(), host_params=sum(map(_numel, on_host)),
                          first_params=_numel(on_host[0]) if on_host and homes[0] else 0,
                          pcie_bytes=sum(map(_nbytes, sent_down)) + sum(map(_nbytes, back_srcs)))
        return work_out, HostState(host, inner)

    return Optimizer(init, update, fuses=True)


def _uploads(pin: bool) -> Uploads:
    """The copies of updated host values to the device (a seam: tests stand in late copies)."""
    return Uploads(pin)


def _copy_back(uploads: Uploads, dst: torch.Tensor, src: torch.Tensor):
    """A unit's updated host copy into its device buffer; the upload's mark (None: nothing copied)."""
    return None if dst is src else uploads.copy(dst, src)


def _pending(tree, done: dict):
    """``tree`` with every ``Params`` in it (the parameters, the optimizer's moments, the master)
    waiting for ``done``'s units before its values are read (``Params``' filling), and refusing
    every read once the update failed (their shared ``Fault``)."""
    if tree is None:
        return None
    fault = next((d.fault for d in done.values()), None)
    return optree.tree_map(lambda t: t.waiting_for(done, fault) if isinstance(t, Params) else t,
                           tree, is_leaf=lambda t: isinstance(t, Params), none_is_leaf=True, namespace=NAMESPACE)


def _off_cpu(tree) -> bool:
    return any(t.device.type != "cpu" for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _numel(tree) -> int:
    return sum(t.numel() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _leaves(tree) -> list:
    """A ``Params``'s leaves, one per unit (``None`` where a unit has none); any other tree as one."""
    return list(tree.leaves) if isinstance(tree, Params) else [tree]


def _host_units(params) -> list[bool]:
    """Per unit, whether its update runs on the host (its placement's ``opt_home``); for a tree
    that is no ``Params``, all of it does."""
    if not isinstance(params, Params):
        return [True]
    return [p.opt_home == CPU for p in params.spec.placements]


def _by_unit(tree, which: list[bool], fn):
    """``tree`` with ``fn`` applied to the leaves of the units ``which`` marks."""
    if not isinstance(tree, Params):
        return tree_map(fn, tree) if which[0] else tree
    return Params(tree.spec, [fn(t) if t is not None and on else t for t, on in zip(tree.leaves, which)])


def _with_host_copies(params, host, only_where_set: bool = False):
    """Per unit, ``host``'s leaf where it has one, else ``params``'s (``None`` with ``only_where_set``)."""
    if not isinstance(params, Params):
        return host
    return Params(params.spec, [h if h is not None else (None if only_where_set else t)
                                for t, h in zip(params.leaves, _leaves(host))])


def _as_stored(params, copies: list[bool], pin: bool):
    """Host copies of the units ``copies`` marks (``None`` for the others), in the dtype each
    unit's placement stores them in: ``Step.init`` runs the optimizer's init before it casts the
    parameters, so the master starts from the model's own values; the host copy the update
    writes and copies back must match the cast."""
    if not isinstance(params, Params):
        return tree_map(lambda t: to_host(t, pin), params)
    leaves = [None if t is None or not c else to_host(t if p.param_dtype in (None, t.dtype) else t.to(p.param_dtype), pin)
              for t, p, c in zip(params.leaves, params.spec.placements, copies)]
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

    def close(self) -> None:
        pass  # after a failed init: its pinned copies go with the last reference to them


class Offload(Transform):
    family = "offload"

    def __init__(self, pin_memory: bool, copy_grads_on_host: bool = False, params: bool = False,
                 plan: OffloadPlan | None = None, ratio: float | None = None, budget: int | None = None,
                 rates: Rates | None = None, overlap: bool | None = None, accumulate_on: str = "device",
                 delay: int = 0, delay_after: int = 0, host_cores=None):
        self.pin_memory = pin_memory
        self.delay, self.delay_after = delay, delay_after  # the delayed update (zfunc.transforms.offload.delayed)
        self.accumulate_on = accumulate_on
        # the host update behind the next forward (zfunc.transforms.offload.host_update); default: for a state
        # that computes on CUDA (decided per update: a CPU state on a machine with CUDA runs it in the step)
        if overlap and accumulate_on == "host":
            raise ValueError("offload_cpu: overlap=True cannot be combined with accumulate_on='host' (on an H200 the "
                             "update behind the next forward then differed from the synchronous one); leave overlap "
                             "unset, or use accumulate_on='device'")
        self._overlap_on_cpu = bool(overlap)  # given True: wherever the state computes
        if overlap is None:  # the host sums' update runs after backward: see the error above
            overlap = torch.cuda.is_available() and accumulate_on != "host"
        if host_cores is not None and not overlap:
            raise ValueError("offload_cpu: host_cores pins the worker that runs the update behind the next forward, "
                             "and this offload_cpu has none (overlap is off: its default on a machine without CUDA); "
                             "give overlap=True, or leave host_cores unset")
        self.overlap = UnitUpdates(resolve_cores(host_cores)) if overlap else None
        self.copy_grads_on_host = copy_grads_on_host
        self.params = params
        self.plan, self.ratio, self.budget, self.rates = plan, ratio, budget, rates
        self._kept: dict = {}  # id(ModelSpec) -> (spec, the plan made for it)
        self._record: dict = {}  # the last update's times and traffic (host_optimizer), for the roofline
        self._micro = 1  # micro-batches a step (accumulate's n, seen when the step places its units)

    @property
    def name(self) -> str:
        return "offload_cpu"

    def describe(self, inner: str) -> str:
        delayed = f", delay={self.delay}, delay_after={self.delay_after}" if self.delay else ""
        return f"offload_cpu({inner}{', params=True' if self.params else ''}{delayed})"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(offload_cpu(f))")

    def params_off_device_error(self, stage: int) -> str | None:
        if not self.params:
            return None
        return (f"offload_cpu(params=True) needs zero3: zero{stage} keeps the full parameters on the device of "
                f"every rank; write zero3(offload_cpu(f, params=True)), or zero{stage}(offload_cpu(f)) to "
                "offload the optimizer state only")

    def place(self, p: Placement, unit) -> Placement:
        return replace(p, opt_home=CPU, grad_home=CPU, param_home=CPU if self.params else p.param_home,
                       acc_home=CPU if self.accumulate_on == "host" else p.acc_home)

    def place_in(self, p: Placement, unit, spec, step) -> Placement:
        self._micro = next((t.n for t in step.transforms if t.family == "accumulate"), 1)  # for the roofline
        plan = self.plan_for(spec, step, p)
        if plan is not None and unit.name in plan.device_units:
            return p  # its optimizer state, master and gradient stay on the device, updated there
        return self.place(p, unit)

    def plan_for(self, spec, step, p: Placement) -> OffloadPlan | None:
        """The split of ``spec``'s units between the device and the host (``make_device_plan``), made
        once per model spec."""
        if self.plan is None and self.ratio is None and self.budget is None:
            return None
        return once_per_spec(self._kept, spec, lambda: make_device_plan(spec, step, self, p, self.plan, self.ratio,
                                                                        self.budget, self.rates))

    def begin_step(self, state):
        self._record.clear()
        if self.rates is None:  # this machine's, once per transform (measured, or read from the cache), while
            # the host is idle: measured after a step, the update running behind it shared the cores (run 5
            # measured the CPU Adam at a twentieth of its rate)
            self.rates = measure_rates(dist.compute_device(state.params.spec.process_group))
        return time.perf_counter()

    def step_metrics(self, state, begun) -> dict:
        """``offload``: the step's roofline (``zfunc.transforms.offload.plan.roofline``) at this machine's rates."""
        r = self._record
        if begun is None or "started" not in r:
            return {}
        waited = None if self.overlap is None else self.overlap.take_waited()
        per_param = r["pcie_bytes"] / r["host_params"] if r["host_params"] else 0.0  # roofline takes bytes a parameter
        out = roofline(r["started"] - begun, r["ended"] - r["started"], r["host_params"], r["first_params"],
                       per_param, self.rates, waited_s=waited, micro_batches=self._micro)
        if self.overlap is not None:  # the cores the update's worker is pinned to (None: unpinned)
            out["host_cores"] = self.overlap.cores
        if self.delay:  # this step's update lands at the next step that updates (delay=), or at once
            out["delayed"] = r.get("delayed", False)
        return {"offload": out}

    def init_home(self, step, spec, places, group):
        """Before anything is made: refuse optimizer state (master weights included) that this
        machine's memory cannot hold. With ``params=True``: host-homed shards go to (pinned) host
        memory as they are made."""
        per_elem = state_bytes_per_element(step.update_part(below=self))
        check_host_memory("offload_cpu", {"optimizer state kept in host memory": host_state_bytes(
            spec, places, dist.world_size(group), per_elem)}, "keep more units' update on the device (budget=, "
            "ratio= or plan=), offload the state to disk (offload_nvme), or shard it over more ranks")
        if not self.params:
            return None
        if not any(t.family == "zero" and t.stage == 3 for t in step.transforms):
            raise ValueError("offload_cpu(params=True) needs zero3, which shards the parameters it keeps on the "
                             "host: write zero3(offload_cpu(f, params=True)), or offload_cpu(f) to offload the "
                             "optimizer state only")
        return _HostHome(self._pin)

    def wrap_optimizer(self, optimizer):
        host = host_optimizer(optimizer, self._pin, self._record, self.overlap, self._overlap_on_cpu)
        if not self.delay:
            return host
        return delayed_optimizer(host, HostState, self._pin, self.delay_after, self._record)

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
                          for t, p in zip(params.leaves_in_flight, params.spec.placements))
            if on_host and not self.copy_grads_on_host:  # nothing to copy: autograd hands them on
                return None
            return GradToHost(grad_spec(params.spec), self._pin)

        return with_grad_sink(grad_fn, sink, self.sum_home)

    def sum_home(self, spec) -> HostSums:
        """An accumulating step's sums of gradients of ``spec`` come to host memory for the host units."""
        return HostSums(spec)


def offload_cpu(step: Step, *, params: bool = False, pin_memory: bool = True,
                copy_grads_on_host: bool = False, plan: OffloadPlan | str | None = None,
                ratio: float | None = None, budget: int | None = None, rates: Rates | None = None,
                overlap: bool | None = None, accumulate_on: str = "device", delay: int = 0,
                delay_after: int = 0, host_cores: int | Sequence[int] | None = None) -> Step:
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
    ``overlap``: run the host's share of each update unit by unit on a worker thread, behind the
    next step's forward, which waits for each unit only when it first uses it
    (zfunc.transforms.offload.host_update; bit for bit the synchronous update). Default: where CUDA is; on a
    CPU-only machine both would share the same cores.
    ``accumulate_on``: where ``accumulate``'s fp32 sums of the host units live between
    micro-batches: ``"device"`` (sent home in the last backward) or ``"host"`` (each micro-batch's
    reduced shard copied down and added in pinned host memory, under zero2 and zero3: 4 bytes a
    parameter less GPU memory, for a copy and a host add every micro-batch, as DeepSpeed's
    ZeRO-Offload does).
    ``delay``: 1 for ZeRO-Offload's delayed parameter update: each update lands one step late, so
    the host runs it behind the whole of the next step's forward and backward, which use the
    parameters from before it (zfunc.transforms.offload.delayed says exactly what it computes);
    0 (the default): the exact update. ``delay_after``: the first that many updates are exact.
    ``host_cores``: the cores of the worker that runs the update behind the next forward (needs
    ``overlap``): a number (the last that many of this process's cores) or a list of core ids; the
    rest are left to the thread that launches the device's work. Default: all but one, where the
    process has three or more (zfunc.transforms.offload.cores); ``metrics["offload"]["host_cores"]``
    says which.
    """
    if accumulate_on not in ("device", "host"):
        raise ValueError(f"offload_cpu: accumulate_on must be 'device' or 'host', got {accumulate_on!r}")
    expect_step(step, "offload_cpu")
    if sum(x is not None for x in (plan, ratio, budget)) > 1:
        raise ValueError("offload_cpu: give one of plan=, ratio= and budget=, which each say which units stay on "
                         "the device")
    if params and (plan is not None or ratio is not None or budget is not None):
        raise ValueError("offload_cpu(params=True) keeps every parameter shard on the host, so no unit's update "
                         "can stay on the device: drop plan=/ratio=/budget=, or params=True")
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload_cpu: ratio must be in [0, 1] (the share of parameters updated on the host), got "
                         f"{ratio}")
    budget = whole(budget, "offload_cpu", "budget")
    plan = as_plan(plan, "offload_cpu")
    check_delay(delay, delay_after, params, plan is not None or ratio is not None or budget is not None)
    return step.then(Offload(pin_memory, copy_grads_on_host, bool(params), plan, ratio, budget, rates, overlap,
                             accumulate_on, delay, delay_after, host_cores))


def make_device_plan(spec, step, offload: Offload, p: Placement, plan, ratio, budget, rates) -> OffloadPlan:
    """The plan given (checked against ``spec``'s units), or one made from ``ratio`` or from
    ``budget`` at ``rates`` (default: this machine's, measured once and cached). Units count this
    rank's part; their state bytes are those of the optimizer inside ``offload``, and their copies
    a gradient and a parameter in the dtype the placement ``p`` stores (the units inside it)."""
    units = rank_units(spec, step)
    state_bytes = state_bytes_per_element(step.update_part(below=offload))
    if plan is not None:
        plan.check(units, state_bytes)
        return plan
    if ratio is not None:
        return plan_for_ratio(units, ratio, state_bytes)
    item = (p.param_dtype or spec.units[0].trainable.dtype).itemsize
    return plan_for_budget(units, budget=budget, rates=rates or measure_rates(dist.compute_device(step.group)),
                           state_bytes=state_bytes, copy_bytes=2 * item)
