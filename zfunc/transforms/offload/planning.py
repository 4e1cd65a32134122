"""``zf.plan_offload``: the split an offload transform would make for a model, as a value to
print, save and pass back (``zfunc.transforms.offload.plan``)."""
from __future__ import annotations

from ... import dist
from .plan import OffloadPlan, whole
from ...placement import Placement
from .rates import Rates
from ...step import Step
from ...optim.whole import whole_params
from ...tree import build_spec
from .cpu import Offload, make_device_plan
from .nvme import OffloadNvme, make_host_plan


def plan_offload(step: Step, model, *, budget: int | None = None, host_budget: int | None = None,
                 rates: Rates | None = None) -> OffloadPlan:
    """The ``OffloadPlan`` the step's offload makes for ``model``: under ``offload_cpu``, the one
    ``offload_cpu(..., budget=budget)`` makes (which units' updates stay on the device; ``rates``
    default to this machine's, measured once and cached: ``zfunc.transforms.offload.rates.measure``); under
    ``offload_nvme``, the one ``offload_nvme(..., host_budget=host_budget)`` makes (which units'
    optimizer state stays in host memory, the rest on disk). Print it, save it, pass it back with
    ``plan=``: it records each unit's size, so a plan given to another model (or world size, or
    optimizer) is refused at init. Budgets are whole numbers of bytes (``4e9`` too)."""
    budget, host_budget = whole(budget, "plan_offload", "budget"), whole(host_budget, "plan_offload", "host_budget")
    offload = next((t for t in step.transforms if t.family == "offload"), None)
    spec = build_spec(model, step.units, dist.world_size(step.group), whole=whole_params(step.optimizer))
    if isinstance(offload, Offload):
        if budget is None or host_budget is not None:
            raise ValueError("plan_offload: under offload_cpu, give budget= (bytes of device memory for the optimizer "
                             "state of the units kept there)")
        p = Placement()
        for t in reversed(step.transforms[step.transforms.index(offload) + 1:]):  # those inside: the stored dtype
            p = t.place(p, spec.units[0])
        return make_device_plan(spec, step, offload, p, None, None, budget, rates or offload.rates)
    if isinstance(offload, OffloadNvme):
        if host_budget is None or budget is not None:
            raise ValueError("plan_offload: under offload_nvme, give host_budget= (bytes of host memory for the "
                             "optimizer state of the units kept there; the rest go to disk)")
        return make_host_plan(spec, step, offload, None, host_budget)
    raise ValueError(f"plan_offload: {step.composition} has no offload_cpu or offload_nvme to plan for")
