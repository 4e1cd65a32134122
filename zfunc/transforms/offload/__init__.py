"""Offload transforms and their planning: optimizer state (and the update) on the host
(``cpu``, with its threaded ``host_update`` and accumulated sums in ``host_sums``), or
parameters, gradients and optimizer state on disk (``nvme``, with its streaming update in
``nvme_update`` and its gradients and sums in ``nvme_grads``); which units go where (``plan``),
from this machine's measured speeds (``rates``), as a value to print and pass back
(``planning``)."""
from .cpu import offload_cpu
from .nvme import offload_nvme
from .plan import OffloadPlan
from .planning import plan_offload
from .rates import Rates

__all__ = ["OffloadPlan", "Rates", "offload_cpu", "offload_nvme", "plan_offload"]
