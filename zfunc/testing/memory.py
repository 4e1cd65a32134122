"""A process's memory as zfunc's tests and benchmarks measure it: resident now, the peak since a
reset, and the CUDA allocator's peak.

A phase's host peak is the kernel's high-water mark of this process's resident memory (VmHWM),
lowered to the current RSS just before the phase (``reset_peak``). getrusage's ``ru_maxrss``
would not do: it cannot be lowered, so it holds every earlier phase's peak, and it carries the
parent's size across fork and exec. Linux only: the figures come from ``/proc/self``.
"""
from __future__ import annotations

import os

import torch

__all__ = ["cuda_peak", "peak", "reset_peak", "rss"]


def rss() -> int:
    """Bytes resident now (VmRSS: /proc/self/statm's resident pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Lower the high-water mark that ``peak`` reads to the current RSS (writing 5 to
    /proc/self/clear_refs, Linux >= 4.0); raises ``OSError`` where the kernel refuses."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    """The most bytes resident at once (VmHWM) since the last ``reset_peak``, or since the process
    started."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def cuda_peak() -> int:
    """The most bytes torch's CUDA allocator had handed out at once on the current device since
    the process started (what it holds cached beyond that is not counted)."""
    return torch.cuda.max_memory_allocated()
