"""Placeholders: a tensor on disk in a state, and the lookups from it to its file.

In the state a tensor on disk is a *placeholder*: a meta tensor of its shape and dtype, which
holds no memory and fails loudly if anything computes with it. A store (zfunc.swap.store) records
each placeholder it makes here, with its file, and itself among the open stores under its key
(the state's ``ParamsSpec.swap``). The rest of zfunc asks here: whether a tensor is on disk,
where (``locate``), its values (``load``), a state's store, and its counts.
"""
from __future__ import annotations

import atexit
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SwapFile:
    """A file a placeholder stands for: ``numel`` elements of ``dtype`` from its start."""

    path: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# placeholder id -> (store, file, placeholder); the store keeps the placeholder alive
_files: dict[int, tuple] = {}
open_stores: dict = {}  # key -> open store (a zfunc.swap.store.SwapStore)


def record(store, file: SwapFile, placeholder: torch.Tensor) -> None:
    """Note ``placeholder`` as ``store``'s, standing for ``file``."""
    _files[id(placeholder)] = (store, file, placeholder)


def by_id(pid: int) -> torch.Tensor:
    """The placeholder whose ``id`` is ``pid`` (``record``-ed)."""
    return _files[pid][2]


def forget(pids) -> None:
    """Drop the placeholders of ids ``pids`` (their store closed)."""
    for pid in pids:
        _files.pop(pid, None)


def _base(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def on_disk(t) -> bool:
    """Whether ``t`` is a placeholder of a swap file (or a view of one)."""
    return isinstance(t, torch.Tensor) and t.device.type == "meta" and id(_base(t)) in _files


def locate(t: torch.Tensor) -> tuple:
    """``(store, file, byte offset)`` of a placeholder or a 1-D view of one."""
    try:
        store, file, _ = _files[id(_base(t))]
    except KeyError:
        raise ValueError("this tensor is not held in a swap file") from None
    store.check_usable()
    return store, file, t.storage_offset() * t.element_size()


def store_of(key: str | None):
    """The open store under ``key`` (None for None); raises if it was closed."""
    if key is None:
        return None
    store = open_stores.get(key)
    if store is None:
        raise RuntimeError(f"the swap files of this state ({key}) were removed by close(); "
                           "a closed state cannot be used: build a new one with step.init")
    return store


def open_store(state):
    """The swap store of ``state`` (``offload_nvme``) if it is still open; else None."""
    key = state.params.spec.swap
    return open_stores.get(key) if key is not None else None


def load(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a new CPU tensor: read from its swap file if it is on disk."""
    if not on_disk(t):
        return t
    store, file, offset = locate(t)
    out = torch.empty(t.shape, dtype=t.dtype)
    store.read_now(out, file, offset)
    return out


def grad_stats(t: torch.Tensor) -> tuple[float, bool]:
    """``(sum of squares, all finite)`` of a gradient, measured when it was written."""
    store, _, _ = locate(t)
    return store.grad_stats[id(_base(t))]


def check_state(state) -> None:
    """Raise if ``state``'s swap files were closed or left half-updated by a failed step."""
    store = store_of(state.params.spec.swap)
    if store is not None:
        store.check_usable()


def io_counts(state) -> dict | None:
    """Bytes the state's store has read and written so far, and its pool's use (``pool_oversize``:
    units larger than a pool buffer read in); None without one."""
    store = open_store(state)
    if store is None:
        return None
    return {"bytes_read": store.bytes_read, "bytes_written": store.bytes_written,
            "pool_peak_buffers": store.pool.peak_in_use, "pool_overflow": store.pool.overflow,
            "pool_oversize": store.oversize}


@atexit.register
def _close_all() -> None:
    """At interpreter exit: every open store's files go."""
    for store in list(open_stores.values()):
        store.close()
