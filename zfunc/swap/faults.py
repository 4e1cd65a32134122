"""Disk errors on demand, so tests run the real error paths of a state's swap files."""
from __future__ import annotations

from ..ops import aio


class Faults:
    """Disk errors on demand, to test the error paths of an ``offload_nvme`` state:
    ``faults = zf.swap.Faults()``, ``zf.offload_nvme(f, path, faults=faults)``, then
    ``faults.arm("update", errno.ENOSPC)``. Every state that step inits shares it; an
    armed fault fails the next request of its phase once (through ``zfunc.ops.aio``'s
    ``AsyncIO.inject_error``, so the real error handling runs)."""

    PHASES = ("read", "grad", "update")

    def __init__(self):
        self._armed: dict[str, int] = {}

    def arm(self, phase: str, err: int) -> None:
        """The next request of ``phase`` ("read": a unit's parameters; "grad": a gradient write;
        "update": the update's writes) fails with errno ``err``."""
        if phase not in self.PHASES:
            raise ValueError(f"phase must be 'read', 'grad' or 'update', got {phase!r}")
        self._armed[phase] = err

    def fire(self, phase: str, handle: aio.AsyncIO) -> None:
        """Hand ``handle`` the fault armed for ``phase``, if one is (then it is spent)."""
        err = self._armed.pop(phase, None)
        if err is not None:
            handle.inject_error(err)
