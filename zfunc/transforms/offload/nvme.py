"""NVMe offload as a step transform: parameters, gradients and optimizer state in swap files
(ZeRO-Infinity).

``offload_nvme(step, path)`` keeps, per unit, this rank's parameter shard (and
its frozen parameters' shard), its gradient and every optimizer-state tensor
(fp32 master, Adam's moments) in swap files under ``path/rank{r}/``
(zfunc.swap). RAM holds a fixed pool of ``buffer_count`` read buffers of at
most ``buffer_size`` elements, the units in use, and the update's three
staging sets of at most ``min(sub_group_size, buffer_size)`` elements of each
tensor, whatever the model's size and however large a unit. Before anything is
made, ``init_home`` checks that this machine's memory holds that much
(``check_host_memory``) and the disk the files.

* init: each unit's shard is staged to disk as it is made (its frozen shard is
  written there once, in its stored dtype: nothing updates it); the optimizer
  state is then built one unit at a time (zfunc.transforms.offload.nvme_update),
  so init never holds more than a unit.
* forward and backward: a unit is read into a pool buffer ahead of use (the
  step's coordinator, zfunc.coordinator, issues the reads, then the
  all-gathers, along the order recorded in the first step), gathered if sharded, and its buffer returned after use; backward
  re-reads it. A unit larger than a pool buffer is read into a buffer of its
  own, which compute uses and drops (on a GPU it passes through the pool
  buffers a part at a time instead: zfunc.swap). Its gradient, once reduced, is written to its swap file at
  once (zfunc.transforms.offload.nvme_grads), with its squared norm and inf/NaN check taken while
  it is in memory, so the step's one agreement on the norm reads nothing back.
* update: streamed over the files in sub-groups, reading ahead and writing behind, the last
  sub-group left resident in RAM for the next step (zfunc.transforms.offload.nvme_update).

On a GPU (nccl) the disk and the optimizer stay on the host: a unit read into a pinned
pool buffer is uploaded to the group's device and gathered there, each gradient
comes back into a pinned staging buffer of a pool buffer's size, a part at a
time, before it is written, and the update runs on host tensors (zfunc.swap's
``Device`` holds the copies and their events). Host memory there is the pool,
the two staging buffers and the update's three sets, whatever the unit sizes.

Write it inside the ZeRO stage and outside ``mixed_precision``:
``zero3(offload_nvme(mixed_precision(f), path))``. ``params=True`` needs zero3
(or no stage at all): zero1/2 keep full parameters on every rank. Under
``accumulate`` the gradient files hold the fp32 sums between micro-batches
(``sum_home``: zfunc.transforms.offload.nvme_grads's ``FileSums``).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from ... import dist, layout, swap
from ...buffers import trim as trim_heap
from ...coordinator import prefetch_settings
from ...grad import grad_spec
from .plan import (OffloadPlan, as_plan, check_host_memory, disk_roofline, host_state_bytes, once_per_spec,
    plan_for_host_budget, rank_units, whole)
from .rates import cached_disk
from .nvme_grads import FileSums, GradToDisk
from .nvme_update import STAGING_SETS, piece_size, swapped_optimizer
from ...optim.base import state_bytes_per_element
from ...placement import CPU, DEVICE, NVME, Placement, grad_is_shard
from ..sinks import with_grad_sink
from ...step import Step, expect_step
from ...transform import Transform, check_inside_zero


class OffloadNvme(Transform):
    family = "offload"

    def __init__(self, path, params: bool, optimizer: bool, buffer_count: int, buffer_size: int,
                 sub_group_size: int, aio: dict | None, prefetch=None, faults: swap.Faults | None = None,
                 plan: OffloadPlan | None = None, host_budget: int | None = None):
        self.prefetch = prefetch  # the coordinator's settings, if given here
        self.plan, self.host_budget = plan, host_budget  # which units' optimizer state stays in host memory
        self._kept: dict = {}  # id(ModelSpec) -> (spec, the plan made for it)
        self.faults = faults  # disk errors armed by a test (swap.Faults), or None
        self.path, self.params, self.optimizer = path, params, optimizer
        self.buffer_count, self.buffer_size = buffer_count, buffer_size
        self.piece = piece_size(sub_group_size, buffer_size)  # elements of each state tensor the update holds at once
        self.aio = aio
        self._record: dict = {}  # the last update's start and end (swapped_optimizer), for the roofline
        self._disk = None  # (the disk's measured (read, write) rates or None), read from the cache once

    @property
    def name(self) -> str:
        return "offload_nvme"

    def describe(self, inner: str) -> str:
        what = [k for k, on in (("params", self.params), ("optimizer", self.optimizer)) if not on]
        return f"offload_nvme({inner}" + "".join(f", {k}=False" for k in what) + ")"

    def check(self, inner) -> None:
        check_inside_zero(self, inner, "zeroN(offload_nvme(f, path))")

    def place(self, p: Placement, unit) -> Placement:
        return replace(p, grad_home=NVME, opt_home=NVME if self.optimizer else CPU,
                       param_home=NVME if self.params else p.param_home)

    def place_in(self, p: Placement, unit, spec, step) -> Placement:
        placed = self.place(p, unit)
        plan = self.plan_for(spec, step)
        if plan is not None and unit.name in plan.host_units:
            return replace(placed, opt_home=CPU)  # its optimizer state (and master) in host memory
        return placed

    def plan_for(self, spec, step) -> OffloadPlan | None:
        """The split of ``spec``'s units' optimizer state between host memory and disk
        (``make_host_plan``), made once per model spec."""
        if self.plan is None and self.host_budget is None:
            return None
        return once_per_spec(self._kept, spec, lambda: make_host_plan(spec, step, self, self.plan, self.host_budget))

    def wrap_optimizer(self, optimizer):
        return swapped_optimizer(optimizer, self.piece, self._record)

    def wrap_grad(self, grad_fn):
        return with_grad_sink(grad_fn, lambda params: GradToDisk(swap.store_of(params.spec.swap),
                                                                 grad_spec(params.spec)), self.sum_home)

    def sum_home(self, spec) -> FileSums | None:
        """An accumulating step's sums of gradients of ``spec`` live in the gradient files (where the
        state has any)."""
        store = swap.store_of(spec.swap)
        return FileSums(store) if store is not None and store.grads else None

    def params_off_device_error(self, stage: int) -> str | None:
        if not self.params:
            return None
        return (f"zero{stage} keeps the full parameters on every rank, so they cannot live on NVMe: "
                f"write zero{stage}(offload_nvme(f, path, params=False)) to offload gradients and "
                "optimizer state, or zero3(offload_nvme(f, path)) to offload parameter shards too")

    def check_state(self, state) -> None:
        swap.check_state(state)

    def begin_step(self, state):
        self._record.clear()
        counts = swap.io_counts(state)
        return None if counts is None else (counts, time.perf_counter())

    def step_metrics(self, state, begun) -> dict:
        """``nvme``: this step's disk traffic (bytes) and the pool's use; ``offload``: its roofline
        against the disk's rates, where ``zfunc.transforms.offload.rates.measure_disk`` has measured them."""
        if begun is None:
            return {}
        begun, t0 = begun
        after = swap.io_counts(state)
        out = {"nvme": {k: after[k] - begun[k] if k.startswith("bytes") else after[k] for k in after}}
        if self._disk is None:  # read once: a step allocates nothing it does not need
            self._disk = (cached_disk(self.path),)
        disk = self._disk[0] if "started" in self._record else None
        if disk is not None:
            r, io = self._record, out["nvme"]
            out["offload"] = disk_roofline(r["started"] - t0, r["ended"] - r["started"], io["bytes_read"],
                                           io["bytes_written"], *disk)
        return out

    def grad_stats(self, g: torch.Tensor) -> tuple[float, bool] | None:
        return swap.grad_stats(g) if swap.on_disk(g) else None

    def move(self, leaf: torch.Tensor, to: str, device: torch.device | None = None) -> torch.Tensor:
        """Off the disk: the leaf's values read into host memory (onto ``device`` for DEVICE; a leaf
        kept on the device comes to the host for CPU). Onto it: a leaf goes there at init
        (``init_home``); one already there stays."""
        if to == CPU:
            return swap.load(leaf).cpu()
        if swap.on_disk(leaf) and to == DEVICE:
            values = swap.load(leaf)
            return values.to(device) if device is not None else values
        if to == NVME and not swap.on_disk(leaf):
            raise NotImplementedError("offload_nvme writes a unit's leaves to their swap files at init; moving "
                                      "a leaf onto the disk later is not supported yet")
        return leaf

    def init_home(self, step: Step, spec, places, group) -> "_DiskHome":
        """At ``Step.init``: the state's swap folder, its free-space check and its gradient files."""
        w, r = dist.world_size(group), dist.rank(group)
        accumulates = step.accumulates
        per_elem = state_bytes_per_element(step.update_part(below=self))
        sizes, need = [], 0
        on_disk = []  # (elements, bytes, unit name) of each parameter file read into the pool
        for i, (unit, place) in enumerate(zip(spec.units, places)):
            padded = unit.trainable.padded
            n = layout.home_numel(padded, w, place.params_sharded)
            n_opt = layout.home_numel(padded, w, place.opt_sharded or place.params_sharded)
            n_grad = layout.home_numel(padded, w, grad_is_shard(place, place.params_sharded))
            item = (place.param_dtype or unit.trainable.dtype).itemsize
            if self.params:  # frozen parameters are read into the pool too: the largest file sizes its buffers
                n_frozen = layout.home_numel(unit.frozen.padded, w, place.params_sharded)
                frozen_item = (place.frozen_dtype or unit.frozen.dtype).itemsize
                need += n * (item + unit.trainable.dtype.itemsize)  # the file, and its staging copy at init
                need += n_frozen * frozen_item
                on_disk += [(n, n * item, unit.name), (n_frozen, n_frozen * frozen_item, unit.name)]
            need += n_grad * (4 if accumulates else item)  # accumulate sums in fp32
            if place.opt_home == NVME:  # units a plan keeps in host memory have no state files
                need += n_opt * per_elem
            shard_start = layout.shard_start(r, layout.shard_numel(padded, w))
            sizes.append((n, n_grad, item, shard_start if place.params_sharded or place.opt_sharded else 0,
                          shard_start if n_grad != padded else 0))
        # a pool buffer: the largest file, at most buffer_size elements (a larger unit is read past the pool)
        buffer_bytes = max((min(nbytes, self.buffer_size * (nbytes // n)) for n, nbytes, _ in on_disk if n), default=0)
        device = swap.device_for(dist.compute_device(group))
        needs = self._host_bytes(spec, places, w, buffer_bytes, per_elem, accumulates, device.copies)
        kept = needs["optimizer state kept in host memory"] = host_state_bytes(spec, places, w, per_elem)
        less = "" if not kept else ("keep less optimizer state in host memory (a smaller host_budget=, or a plan "
                                    "made with one), " if self.optimizer else "put the optimizer state on disk "
                                    "(optimizer=True), ")
        check_host_memory("offload_nvme", needs, less + "lower buffer_count, buffer_size or sub_group_size, or make "
                                                        "smaller units")
        store = swap.SwapStore(self.path, aio_config=self.aio, buffer_count=self.buffer_count,
                               buffer_bytes=buffer_bytes, faults=self.faults, device=device)
        try:
            store.reserve(need)
            store.offsets = [s[3] for s in sizes]
            for i, (unit, place, (_, n_grad, _, _, grad_start)) in enumerate(zip(spec.units, places, sizes)):
                if n_grad:  # accumulate's sums are fp32; else the gradient's own dtype
                    dtype = torch.float32 if accumulates else (place.param_dtype or unit.trainable.dtype)
                    store.grads[i] = store.create(i, unit.name, "grad", n_grad, dtype, grad_start)
        except BaseException:
            store.close()  # a failed init leaves nothing behind (Step.init closes the home once it is made)
            raise
        return _DiskHome(store, r, self.piece)

    def _host_bytes(self, spec, places, w: int, buffer_bytes: int, per_elem: int, accumulates: bool,
                    copies: bool) -> dict[str, int]:
        """What this rank's host memory must hold at least, by part: the read pool, the update's
        staging sets (at most three of ``piece`` elements of parameters, gradients and optimizer
        state), the gradients' two staging buffers from a device, and the largest unit gathered
        where compute runs on the CPU."""
        per_piece, total, largest = 0, 0, 0
        for unit, place in zip(spec.units, places):
            item = (place.param_dtype or unit.trainable.dtype).itemsize
            per_piece = max(per_piece, item * self.params + (4 if accumulates else item) + per_elem * self.optimizer)
            total += layout.home_numel(unit.trainable.padded, w, place.opt_sharded or place.params_sharded)
            largest = max(largest, unit.trainable.padded * item)
        held = min(self.piece, total)
        sets = min(STAGING_SETS, -(-total // held)) if held else 0
        out = {"read pool": self.buffer_count * buffer_bytes, "update staging": sets * held * per_piece}
        out["largest unit" if not copies else "gradient staging"] = largest if not copies else 2 * buffer_bytes
        return out


class _DiskHome:
    """``Step.init``'s leaves of units whose parameters live on disk, written as they are made
    (``Transform.init_home``)."""

    def __init__(self, store: swap.SwapStore, rank: int, piece: int):
        self.store, self.key, self.rank, self.piece = store, store.key, rank, piece

    def keep(self, i: int, unit, place: Placement, leaf: torch.Tensor, frozen: bool) -> torch.Tensor:
        if place.param_home != NVME or not leaf.numel():
            return leaf
        start = layout.shard_start(self.rank, leaf.numel()) if place.params_sharded else 0
        if not frozen:  # the optimizer's init reads these values back once
            return self.store.stage(i, unit.name, leaf, place.param_dtype or leaf.dtype, start)
        stored = leaf.to(place.frozen_dtype or leaf.dtype)  # frozen: written once, in their stored dtype
        return self.store.put(i, unit.name, "frozen", stored, start)

    def close(self) -> None:
        """After a failed ``Step.init``: remove the swap files and the folders init made."""
        self.store.close()

    def finish(self) -> None:
        self.store.finish_staged(self.piece)  # what the optimizer's init did not write (an eval step's init)
        trim_heap()  # init's per-unit temporaries: back to the OS, not left in malloc's heap


def offload_nvme(step: Step, path, *, params: bool = True, optimizer: bool = True, buffer_count: int = 5,
                 buffer_size: int = int(1e8), sub_group_size: int = int(1e9), aio: dict | None = None,
                 prefetch_bucket_size: int | None = None, max_live_parameters: int | None = None,
                 max_reuse_distance: int | None = None, collective_timeout: float | None = None,
                 faults: swap.Faults | None = None, host_budget: int | None = None,
                 plan: OffloadPlan | str | None = None) -> Step:
    """Keep parameters, gradients and optimizer state in swap files under ``path`` (module docstring).

    ``params``: parameter shards on disk too (needs zero3, or no stage);
    ``optimizer``: the optimizer state on disk (else in RAM, as offload_cpu);
    ``buffer_count`` x ``buffer_size`` (elements): the pool units are read
    into (a larger unit gets a buffer of its own while it is used, or on a
    GPU passes through the pool); ``sub_group_size``: elements of each tensor
    the update holds at once, at most ``buffer_size`` (each of three staging
    sets; a larger unit is updated in pieces); ``aio``: DeepSpeed's ``aio`` config section for
    ``zfunc.ops.aio``. The state owns its files: ``state.close()`` (or a
    ``with`` block) removes them; so does interpreter exit.
    ``prefetch_bucket_size``, ``max_live_parameters``, ``max_reuse_distance``,
    ``collective_timeout``: the coordinator's settings, as for ``zero3``: units
    are read from disk (then gathered) ahead of use along the recorded order.
    Settings given to the outermost transform that has any win.
    ``faults``: a ``zf.swap.Faults`` that tests arm to make a disk request fail.
    ``host_budget``: bytes of host memory for optimizer state: the first units' (forward order,
    first fit) stay there, the rest go to disk, so the disk moves only theirs each step
    (``zfunc.transforms.offload.plan.plan_for_host_budget``); ``plan``: such a split (an ``OffloadPlan`` with
    ``disk_units``, or the path of a saved one), from ``zf.plan_offload(step, model, host_budget=)``.
    """
    expect_step(step, "offload_nvme")
    if host_budget is not None and plan is not None:
        raise ValueError("offload_nvme: give one of host_budget= and plan=, which each say which units' optimizer "
                         "state stays in host memory")
    if (host_budget is not None or plan is not None) and not optimizer:
        raise ValueError("offload_nvme(optimizer=False) keeps every unit's optimizer state in host memory already: "
                         "drop host_budget=/plan=, or optimizer=False")
    host_budget = whole(host_budget, "offload_nvme", "host_budget")
    plan = as_plan(plan, "offload_nvme")
    if plan is not None and plan.device_units:
        raise ValueError(f"offload_nvme keeps no unit's update on the device, but this plan keeps "
                         f"{list(plan.device_units)[:3]} there; make it with zf.plan_offload(step, model, "
                         "host_budget=...), or use offload_cpu(plan=...)")
    if path is None or not str(path):
        raise ValueError("offload_nvme needs path=, a folder on a fast local disk for the swap files")
    buffer_count, buffer_size, sub_group_size = (
        whole(value, "offload_nvme", key, least=1, unit=unit) for key, value, unit in (
            ("buffer_count", buffer_count, "buffers"), ("buffer_size", buffer_size, "elements"),
            ("sub_group_size", sub_group_size, "elements")))
    return step.then(OffloadNvme(path, bool(params), bool(optimizer), buffer_count, buffer_size,
                                 sub_group_size, aio, prefetch_settings(
        prefetch_bucket_size=prefetch_bucket_size, max_live_parameters=max_live_parameters,
        max_reuse_distance=max_reuse_distance, collective_timeout=collective_timeout), faults, plan, host_budget))


def make_host_plan(spec, step, offload: OffloadNvme, plan, host_budget) -> OffloadPlan:
    """The plan given (checked against ``spec``'s units), or one made from ``host_budget``: units
    count this rank's part, at the state bytes of the optimizer inside ``offload``; the disk's rates
    (if ``zfunc.transforms.offload.rates.measure_disk`` measured them) predict its traffic."""
    units = rank_units(spec, step)
    state_bytes = state_bytes_per_element(step.update_part(below=offload))
    if plan is not None:
        plan.check(units, state_bytes)
        return plan
    return plan_for_host_budget(units, budget=host_budget, state_bytes=state_bytes,
                                disk=cached_disk(offload.path) if os.path.exists(offload.path) else None)
