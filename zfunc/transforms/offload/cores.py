"""Which cores the host update's worker runs on, so it never starves the thread that launches work.

Behind the next forward (``overlap``, ``delay``) the host's Adam runs on offload_cpu's worker
thread while the main thread queues the device's kernels. Left alone, the kernel's OpenMP team
takes every core and the launching thread waits for one, so the device idles (run 5 measured the
forward's launches slowed by the update beside them). SuperOffload and ZenFlow give the CPU
optimizer cores of its own; so does zfunc: the worker pins itself to ``host_cores`` and runs as many
threads as it has cores (its OpenMP team, created from the worker, inherits the pin), and the cores
left over are the launcher's. Linux only (``os.sched_setaffinity``); elsewhere the worker runs
unpinned and says so.
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

LAUNCH_CORES = 1  # kept off the worker by default: the thread that launches the device's work


def available() -> list[int] | None:
    """The cores this process may run on, or None where the platform cannot pin threads."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def resolve(host_cores: int | Iterable[int] | None, cores: list[int] | None = None) -> list[int] | None:
    """The cores the worker gets (``cores``: the process's; default, this process's), or None for no pin.

    ``None``: every core but ``LAUNCH_CORES`` (the last ones), where at least three are free; fewer
    than that and a pin would halve the update, so the worker runs unpinned. An int ``k``: the last
    ``k`` cores, leaving the rest to the launcher. A collection: exactly those core ids."""
    cores = available() if cores is None else sorted(cores)
    if cores is None:
        if host_cores is not None:
            raise ValueError("offload_cpu: host_cores needs os.sched_setaffinity (Linux) to pin the update's "
                             "worker; leave host_cores unset on this platform")
        return None
    if host_cores is None:
        return cores[:-LAUNCH_CORES] if len(cores) >= 3 else None
    if isinstance(host_cores, (bool, str)) or not isinstance(host_cores, (int, Iterable)):
        raise TypeError(f"offload_cpu: host_cores must be a number of cores or a list of core ids, got "
                        f"{host_cores!r}")
    if isinstance(host_cores, int):
        if not 1 <= host_cores < len(cores):
            raise ValueError(f"offload_cpu: host_cores={host_cores} must leave the launching thread at least one "
                             f"of this process's {len(cores)} cores: give 1 to {len(cores) - 1}")
        return cores[-host_cores:]
    chosen = sorted(set(host_cores))
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in chosen):
        raise TypeError(f"offload_cpu: host_cores must be a number of cores or a list of core ids, got {host_cores!r}")
    missing = sorted(set(chosen) - set(cores))
    if not chosen or missing:
        raise ValueError(f"offload_cpu: host_cores {chosen} must be a non-empty subset of the cores this process "
                         f"may use, {cores}" + (f"; {missing} are not among them" if missing else ""))
    return chosen


def pin_worker(cores: list[int] | None) -> None:
    """Run on the worker thread as it starts: pin it (and the OpenMP team it will create) to ``cores``
    and give its kernels one thread a core. ``None``: leave it as it is."""
    if cores is None:
        return
    os.sched_setaffinity(0, cores)  # 0: the calling thread, on Linux
    torch.set_num_threads(len(cores))
