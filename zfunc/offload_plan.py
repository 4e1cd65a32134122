"""Which units' updates ``offload_cpu`` leaves on the device (and ``offload_nvme`` in host memory),
and the roofline of an offloaded step.

DeepSpeed's Twin-Flow sets by hand the share of the optimizer state updated on the host
(``offload_optimizer.ratio``). Here the split is a value, an ``OffloadPlan``: made from a ratio
(``plan_for_ratio``) or from a device-memory budget and this machine's measured rates
(``plan_for_budget``), printed, saved, loaded and handed back to ``offload_cpu(step, plan=...)``.

Units kept on the device are taken in the order the forward uses them: the next step's forward
needs the first units first, and their update on the device (about 20x the host's rate) is done
before the host's; the host updates the rest, whose gradients leave the device first in backward.

Under ``offload_nvme`` the same value says which units' optimizer state stays in host memory
(``host_units``) and which goes to swap files (``disk_units``): ``plan_for_host_budget`` keeps
as many as fit a budget of host bytes, so the disk moves only the rest's state each step.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from . import dist
from .rates import INF, Rates


@dataclass(frozen=True)
class OffloadPlan:
    """``device_units``: names of the units (``""`` the root) whose optimizer state, master
    weights and gradients stay on the device, updated there; every other unit's are on the host.
    ``predicted``: seconds a step's update takes by part, from ``rates`` (empty for a ratio)."""

    device_units: tuple[str, ...]
    host_units: tuple[str, ...]
    budget: int | None = None  # bytes of device memory the kept state may use
    device_bytes: int = 0  # bytes the kept state takes on each device
    predicted: dict = field(default_factory=dict, compare=False)
    rates: Rates | None = field(default=None, compare=False)
    disk_units: tuple[str, ...] = ()  # offload_nvme: units whose optimizer state is in swap files
    host_budget: int | None = None  # offload_nvme: bytes of host memory the state kept there may use
    host_bytes: int = 0  # the bytes it takes

    def __str__(self) -> str:
        if self.disk_units or self.host_budget is not None:
            lines = [f"OffloadPlan: {len(self.host_units)} units' optimizer state in host memory "
                     f"({self.host_bytes / 2**30:.2f} GiB"
                     + (f", budget {self.host_budget / 2**30:.2f} GiB" if self.host_budget is not None else "")
                     + f"), {len(self.disk_units)} on disk"]
        else:
            lines = [f"OffloadPlan: {len(self.device_units)} units updated on the device "
                     f"({self.device_bytes / 2**30:.2f} GiB of state"
                     + (f", budget {self.budget / 2**30:.2f} GiB" if self.budget is not None else "") + f"), "
                     f"{len(self.host_units)} on the host"]
        lines += [f"  {k}: {v:.3f} s" for k, v in self.predicted.items()]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"device_units": list(self.device_units), "host_units": list(self.host_units),
                           "disk_units": list(self.disk_units), "budget": self.budget,
                           "device_bytes": self.device_bytes, "host_budget": self.host_budget,
                           "host_bytes": self.host_bytes, "predicted": self.predicted,
                           "rates": None if self.rates is None else self.rates.to_dict()}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "OffloadPlan":
        d = json.loads(text)
        return cls(tuple(d["device_units"]), tuple(d["host_units"]), d["budget"], d["device_bytes"],
                   d.get("predicted") or {}, None if d.get("rates") is None else Rates.from_dict(d["rates"]),
                   tuple(d.get("disk_units", ())), d.get("host_budget"), d.get("host_bytes", 0))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "OffloadPlan":
        return cls.from_json(Path(path).read_text())

    def check(self, names: Sequence[str]) -> None:
        """Raise naming what differs where this plan was made for other units than ``names``."""
        mine, theirs = set(self.device_units) | set(self.host_units) | set(self.disk_units), set(names)
        if mine != theirs:
            raise ValueError(
                f"this OffloadPlan was made for other units: the model has {sorted(theirs - mine)[:5]} that it does "
                f"not name and it names {sorted(mine - theirs)[:5]} that the model lacks; make the plan again for "
                "this model (zf.plan_offload, or offload_cpu(ratio=...))")


def as_plan(plan, who: str) -> "OffloadPlan | None":
    """``plan`` as an ``OffloadPlan``: itself, or loaded from the path of a saved one."""
    if isinstance(plan, (str, os.PathLike)):
        plan = OffloadPlan.load(plan)
    if plan is not None and not isinstance(plan, OffloadPlan):
        raise TypeError(f"{who}: plan must be an OffloadPlan or the path of a saved one, got {type(plan).__name__}")
    return plan


def check_budget(value, who: str, name: str = "budget") -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{who}: {name} must be a number of bytes >= 0, got {value!r}")


def rank_units(spec, step) -> list[tuple[str, int]]:
    """``(name, parameters)`` of ``spec``'s units in forward order, counting this rank's part where
    ``step`` shards them (a ZeRO stage)."""
    w = dist.world_size(step.group) if any(t.family == "zero" for t in step.transforms) else 1
    return [(u.name, -(-u.trainable.padded // w)) for u in spec.units]


def once_per_spec(kept: dict, spec, make: Callable[[], "OffloadPlan"]) -> "OffloadPlan":
    """The plan ``make()`` made for ``spec``, made once (``kept``: the transform's, by spec)."""
    made = kept.get(id(spec))
    if made is None or made[0] is not spec:
        made = kept[id(spec)] = (spec, make())
    return made[1]


def _first_fit(units: Sequence[tuple[str, int]], budget: int, state_bytes: int) -> tuple[list[str], int]:
    """The units whose state (``state_bytes`` a parameter) fits in ``budget`` bytes, taken in
    order, first fit; and the bytes they take."""
    left, kept = budget, []
    for name, n in units:
        if n * state_bytes <= left:
            kept.append(name)
            left -= n * state_bytes
    return kept, budget - left


def predict(units: Sequence[tuple[str, int]], device: set[str], rates: Rates, copy_bytes: int) -> dict:
    """Seconds a step's update takes by part: the host's Adam over its units, their copies
    (gradients down, parameters up: ``copy_bytes`` a parameter) and the device's Adam."""
    n_host = sum(n for name, n in units if name not in device)
    n_dev = sum(n for name, n in units if name in device)
    return {"host update": n_host / rates.host_update, "copies": n_host * copy_bytes / rates.pcie,
            "device update": 0.0 if rates.device_update == INF else n_dev / rates.device_update}


def plan_for_budget(units: Sequence[tuple[str, int]], *, budget: int, rates: Rates, state_bytes: int,
                    copy_bytes: int) -> OffloadPlan:
    """Keep on the device as many units' update state (``state_bytes`` a parameter) as fit in
    ``budget`` bytes, taken in forward order, first fit (``units``: (name, parameters on this
    rank), in that order); each one kept moves its update from the host's rate to the device's and
    saves its copies, so the step's update time falls with every byte of the budget used."""
    if budget < 0:
        raise ValueError(f"plan_for_budget: budget must be >= 0 bytes, got {budget}")
    # a host as fast as the device: keep the device's memory free
    device, used = _first_fit(units, budget, state_bytes) if rates.device_update > rates.host_update else ([], 0)
    kept = set(device)
    return OffloadPlan(tuple(device), tuple(name for name, _ in units if name not in kept), budget, used,
                       predict(units, kept, rates, copy_bytes), rates)


def plan_for_ratio(units: Sequence[tuple[str, int]], ratio: float, state_bytes: int = 0) -> OffloadPlan:
    """DeepSpeed's ``offload_optimizer.ratio``: about ``ratio`` of the parameters updated on the
    host, the first units in forward order (up to ``1 - ratio`` of them) on the device."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload ratio must be in [0, 1] (the share of parameters updated on the host), got {ratio}")
    total = sum(n for _, n in units)
    keep, device = (1.0 - ratio) * total, []
    for name, n in units:
        if n <= keep:
            device.append(name)
            keep -= n
        else:
            break
    kept = set(device)
    return OffloadPlan(tuple(device), tuple(name for name, _ in units if name not in kept), None,
                       sum(n for name, n in units if name in kept) * state_bytes)


def plan_for_host_budget(units: Sequence[tuple[str, int]], *, budget: int, state_bytes: int,
                         disk: tuple[float, float] | None = None) -> OffloadPlan:
    """``offload_nvme``'s split: keep in host memory as many units' optimizer state (``state_bytes``
    a parameter) as fit in ``budget`` bytes, in forward order, first fit; the rest in swap files.
    Every byte kept is a byte the disk neither reads nor writes in a step's update; ``disk``: the
    disk's measured (read, write) bytes a second, to predict the seconds that traffic takes."""
    if budget < 0:
        raise ValueError(f"plan_for_host_budget: budget must be >= 0 bytes, got {budget}")
    host, used = _first_fit(units, budget, state_bytes)
    kept = set(host)
    on_disk = sum(n for name, n in units if name not in kept) * state_bytes
    predicted = {} if disk is None else {"disk (optimizer state read and written)": on_disk / disk[0] + on_disk / disk[1]}
    return OffloadPlan((), tuple(host), predicted=predicted, disk_units=tuple(n for n, _ in units if n not in kept),
                       host_budget=budget, host_bytes=used)


def roofline(compute_s: float, update_s: float, host_params: int, first_params: int, copy_bytes: int,
             rates: Rates, waited_s: float | None = None, micro_batches: int = 1) -> dict:
    """The bound of an offloaded step and how close the step came to it.

    ``compute_s``: measured forward and backward (begin to the update; with the update behind the
    next forward, ``waited_s`` of it the forward's waits for the previous update); ``update_s``:
    the measured update after them (with ``overlap``, only its part in the step). The bound is the
    largest of three: the host's Adam over its ``host_params`` at the measured rate; their copies
    (gradients down, parameters up) at the measured PCIe rate; and the compute plus what exactness
    forces to be serial after it. Nothing of a unit's update can start before every gradient is
    agreed (clipping, the loss scale and the inf/NaN check need it), and the next forward needs
    every unit within its first micro-batch's forward (``forward_s``: a third of the compute, a
    backward costing twice a forward, over ``micro_batches``); so serial is the larger of the first
    unit's update and upload (``first_params`` of it on the host), and what of the host update
    that forward cannot cover. ``achieved`` is the bound over the step's time; ``binds`` names the
    largest part."""
    host_s = host_params / rates.host_update
    copy_s = host_params * copy_bytes / rates.pcie
    pure = compute_s - (waited_s or 0.0)
    forward_s = pure / (3 * max(1, micro_batches))
    first = first_params / rates.host_update + first_params * copy_bytes / rates.pcie
    serial = max(first, host_s - forward_s)
    parts = {"compute": pure + serial, "host update": host_s, "copies": copy_s}
    bound = max(parts.values())
    step_s = compute_s + update_s
    out = {"compute_s": compute_s, "update_s": update_s, "host_update_s": host_s, "copies_s": copy_s,
           "pcie_bytes": host_params * copy_bytes, "serial_s": serial, "bound_s": bound,
           "binds": max(parts, key=parts.get), "achieved": bound / step_s if step_s > 0 else 0.0}
    return out | ({} if waited_s is None else {"waited_s": waited_s})


def disk_roofline(compute_s: float, update_s: float, bytes_read: int, bytes_written: int, read_rate: float,
                  write_rate: float) -> dict:
    """The same for ``offload_nvme``: the step's disk traffic at the disk's measured rates
    (``disk_s``) against its measured compute; ``disk_fraction`` is the share of the step the disk
    would be busy at those rates (near 1: the step runs at the disk's speed)."""
    disk_s = bytes_read / read_rate + bytes_written / write_rate
    parts = {"compute": compute_s, "disk": disk_s}
    bound = max(parts.values())
    step_s = compute_s + update_s
    return {"compute_s": compute_s, "update_s": update_s, "disk_bytes": bytes_read + bytes_written, "disk_s": disk_s,
            "bound_s": bound, "binds": max(parts, key=parts.get), "achieved": bound / step_s if step_s > 0 else 0.0,
            "disk_fraction": disk_s / step_s if step_s > 0 else 0.0}
