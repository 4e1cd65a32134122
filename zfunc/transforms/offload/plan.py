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
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ... import dist, layout
from ...placement import CPU
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
    # (name, parameters on each rank) of every unit, in forward order, and optimizer-state bytes a
    # parameter, as the planner saw them: what ``check`` compares with the model it is given to
    unit_sizes: tuple[tuple[str, int], ...] = ()
    state_bytes: int = 0

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
                           "host_bytes": self.host_bytes, "unit_sizes": [list(u) for u in self.unit_sizes],
                           "state_bytes": self.state_bytes, "predicted": self.predicted,
                           "rates": None if self.rates is None else self.rates.to_dict()}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "OffloadPlan":
        d = json.loads(text)
        return cls(tuple(d["device_units"]), tuple(d["host_units"]), d["budget"], d["device_bytes"],
                   d.get("predicted") or {}, None if d.get("rates") is None else Rates.from_dict(d["rates"]),
                   tuple(d.get("disk_units", ())), d.get("host_budget"), d.get("host_bytes", 0),
                   tuple((str(n), int(k)) for n, k in d.get("unit_sizes", ())), d.get("state_bytes", 0))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "OffloadPlan":
        return cls.from_json(Path(path).read_text())

    def check(self, units: Sequence[tuple[str, int]], state_bytes: int) -> None:
        """Raise, naming what differs, where this plan was made for another model or step than the
        one it is given to: ``units``, (name, parameters on this rank) in forward order, and
        ``state_bytes``, the optimizer state a parameter takes there. A plan whose names match but
        whose sizes do not would keep other amounts on the device (or in host memory) than it says."""
        nvme = bool(self.disk_units) or self.host_budget is not None  # offload_nvme's: host_units' state in RAM
        again = ("; make the plan again for this model, world size and step: zf.plan_offload(step, model, "
                 f"{'host_budget' if nvme else 'budget'}=...)")
        mine, theirs = set(self.device_units) | set(self.host_units) | set(self.disk_units), {n for n, _ in units}
        if mine != theirs:
            raise ValueError(
                f"this OffloadPlan was made for other units: the model has {sorted(theirs - mine)[:5]} that it does "
                f"not name and it names {sorted(mine - theirs)[:5]} that the model lacks" + again)
        planned = dict(self.unit_sizes)  # empty for a plan written by hand, names only
        wrong = [(name, planned.get(name), n) for name, n in units if planned and planned.get(name) != n]
        if wrong:
            name, was, now = wrong[0]
            more = f" (and {len(wrong) - 1} more units differ)" if len(wrong) > 1 else ""
            raise ValueError(f"this OffloadPlan was made for another model: unit {name!r} has {now} parameters on "
                             f"this rank, the plan was made for {was}{more}" + again)
        if self.state_bytes and self.state_bytes != state_bytes:  # 0: not recorded (a plan written by hand)
            raise ValueError(f"this OffloadPlan was made for an optimizer state of {self.state_bytes} bytes a "
                             f"parameter, this step's takes {state_bytes} (another optimizer or precision)" + again)
        n = dict(units)
        sides = [("device memory", self.device_units, self.device_bytes, self.budget, "budget")]
        if nvme:
            sides.append(("host memory", self.host_units, self.host_bytes, self.host_budget, "host_budget"))
        for where, names, said, budget, key in sides:
            used = sum(n[name] for name in names) * state_bytes
            if budget is not None and used > budget:
                raise ValueError(f"this OffloadPlan keeps {used} bytes of optimizer state in {where} in this model, "
                                 f"more than its {key} of {budget}" + again)
            if (said or budget is not None) and used != said:
                raise ValueError(f"this OffloadPlan says its units keep {said} bytes of optimizer state in {where}; "
                                 f"in this model they keep {used}" + again)


def as_plan(plan, who: str) -> "OffloadPlan | None":
    """``plan`` as an ``OffloadPlan``: itself, or loaded from the path of a saved one."""
    if isinstance(plan, (str, os.PathLike)):
        plan = OffloadPlan.load(plan)
    if plan is not None and not isinstance(plan, OffloadPlan):
        raise TypeError(f"{who}: plan must be an OffloadPlan or the path of a saved one, got {type(plan).__name__}")
    return plan


def whole(value, who: str, name: str, *, least: int = 0, unit: str = "bytes") -> int | None:
    """``value`` (``None`` stays ``None``) as an ``int`` of at least ``least``: any integral number,
    a float with no fractional part too (DeepSpeed configs write ``4e9``), numpy's ints and floats;
    a bool, a fraction, NaN, an infinity or a smaller number raise, naming the argument."""
    if value is None:
        return None
    integral = not isinstance(value, bool) and (isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer()))
    out = int(value) if integral else None
    if out is None or out < least:
        what = f"a positive number of {unit}" if least == 1 else f"a number of {unit} >= {least}"
        raise ValueError(f"{who}: {name} must be {what}, a whole one (an int, or a float with no fractional part "
                         f"such as 4e9), got {value!r}")
    return out


def check_host_memory(who: str, needs: dict[str, int], hint: str) -> None:
    """Raise at init, saying how much is needed by part and how much is available, where this
    machine's available memory cannot hold what ``who`` keeps in host memory on this rank (parts of
    zero bytes are left out); ``hint``: what to do about it."""
    needs = {k: v for k, v in needs.items() if v}
    free, total = available_memory(), sum(needs.values())
    if free is not None and total > free:
        parts = ", ".join(f"{k} {v}" for k, v in needs.items())
        raise MemoryError(f"{who} needs at least {total} bytes of host memory on this rank ({parts}), "
                          f"{total - free} more than the {free} bytes available: {hint}")


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (``MemAvailable``), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def host_state_bytes(spec, places, w: int, per_elem: int) -> int:
    """Bytes of optimizer state (master weights included: ``per_elem`` counts them) that the units
    whose placement keeps it in host memory (``opt_home`` CPU) hold on this rank of ``w``."""
    return per_elem * sum(layout.home_numel(u.trainable.padded, w, p.opt_sharded or p.params_sharded)
                          for u, p in zip(spec.units, places) if p.opt_home == CPU)


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
    budget = whole(budget, "plan_for_budget", "budget")
    # a host as fast as the device: keep the device's memory free
    device, used = _first_fit(units, budget, state_bytes) if rates.device_update > rates.host_update else ([], 0)
    kept = set(device)
    return OffloadPlan(tuple(device), tuple(name for name, _ in units if name not in kept), budget, used,
                       predict(units, kept, rates, copy_bytes), rates, unit_sizes=_sizes(units),
                       state_bytes=state_bytes)


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
                       sum(n for name, n in units if name in kept) * state_bytes, unit_sizes=_sizes(units),
                       state_bytes=state_bytes)


def plan_for_host_budget(units: Sequence[tuple[str, int]], *, budget: int, state_bytes: int,
                         disk: tuple[float, float] | None = None) -> OffloadPlan:
    """``offload_nvme``'s split: keep in host memory as many units' optimizer state (``state_bytes``
    a parameter) as fit in ``budget`` bytes, in forward order, first fit; the rest in swap files.
    Every byte kept is a byte the disk neither reads nor writes in a step's update; ``disk``: the
    disk's measured (read, write) bytes a second, to predict the seconds that traffic takes."""
    budget = whole(budget, "plan_for_host_budget", "budget")
    host, used = _first_fit(units, budget, state_bytes)
    kept = set(host)
    on_disk = sum(n for name, n in units if name not in kept) * state_bytes
    predicted = {} if disk is None else {"disk (optimizer state read and written)": on_disk / disk[0] + on_disk / disk[1]}
    return OffloadPlan((), tuple(host), predicted=predicted, disk_units=tuple(n for n, _ in units if n not in kept),
                       host_budget=budget, host_bytes=used, unit_sizes=_sizes(units), state_bytes=state_bytes)


def _sizes(units: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple((str(name), int(n)) for name, n in units)


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
