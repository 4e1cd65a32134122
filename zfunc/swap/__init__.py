"""Swap files: where ``offload_nvme`` keeps a state's tensors on disk, and the host buffers
they pass through.

* ``store``: a state's ``SwapStore``: its folder (``folders``), its files, their reads and
  writes, its failures (``Faults`` arms them in tests, ``faults``);
* ``placeholders``: a tensor on disk in the state, and the lookups from it to its file and from a
  state to its store (``on_disk``, ``locate``, ``load``, ``store_of``, ...);
* ``pool``: the aligned host buffers units are read into (``BufferPool``, ``aligned``, ``parts``);
* ``device``: the copies between those buffers and an accelerator (``Device``, ``device_for``).
"""
from .device import Device, device_for
from .faults import Faults
from .placeholders import check_state, grad_stats, io_counts, load, locate, on_disk, open_store, store_of
from .pool import BufferPool, aligned, parts
from .store import SwapStore

__all__ = ["BufferPool", "Device", "Faults", "SwapStore", "aligned", "check_state", "device_for", "grad_stats",
           "io_counts", "load", "locate", "on_disk", "open_store", "parts", "store_of"]
