"""``zf.offload_states`` and ``zf.reload_states``: a training state's parts moved off the compute
device between phases (an inference engine generating rollouts on the same devices), and back.

zfunc's state is a value, so moving it is a function of the value. ``offload_states(state)``
returns an ``OffloadedState``: the chosen parts (parameters, frozen parameters, master weights,
optimizer state) that were on the compute device now sit in host buffers (``device="cpu"``,
page-locked on CUDA, reused from cycle to cycle: ``host_buffers``) or in one file per rank under
``path`` (``device="nvme"``), and their device memory is free when the call returns. The state it
was given is used up: its moved tensors are emptied in place (as DeepSpeed empties ``param.data``),
so whatever else still holds them holds no memory, and every use of it is refused, naming the value
to reload. ``reload_states(offloaded)`` brings the parts back into new device memory and returns a
``State`` equal to the one given, bit for bit, and the file is removed.

What is not on the compute device stays where it is: ``offload_cpu``'s host copy and optimizer
state (already off the device), ``offload_nvme``'s swap files (already on disk). The buffers, the
step count and the loss scale (a few bytes) always stay. On a CPU-only machine the compute device
is the host: ``device="cpu"`` moves nothing (the state is wrapped and refused until reloaded, as on
a GPU, so a program behaves the same on both), and ``device="nvme"`` moves the parts out of RAM.

Offloading and reloading are local to each rank (no collective); every rank of a step offloads
and reloads its own state.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .. import buffers, coordinator, dist, swap
from ..swap.folders import make_marked, remove_made
from ..state import State, check_usable, mark_failed, memory_report
from ..tree import Fault
from .files import OffloadFile, read_into
from .host import host_buffers
from .parts import PARTS, chosen, map_tensors, tensors_by_part

DEVICES = ("cpu", "nvme")


class StateOffloaded(RuntimeError):
    """A use of a state whose parts ``zf.offload_states`` moved off the device."""


class _Refused(Fault):
    """The ``Fault`` an offloaded state's given-up ``Params`` hold: every use raises ``StateOffloaded``."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        super().__init__()
        self.message = message
        self.where = "zf.offload_states"
        self.cause = StateOffloaded(message)
        self.agreed = True  # every rank that offloaded refuses at once, with no collective

    def error(self) -> StateOffloaded:
        return StateOffloaded(self.message)


@dataclass(frozen=True)
class _Storage:
    """One device storage moved: its size and device; its host buffer ("cpu") or file offset ("nvme")."""

    nbytes: int
    device: torch.device
    host: torch.Tensor | None = None
    offset: int = 0


@dataclass(frozen=True)
class _Leaf:
    """Where a moved tensor lay in its storage, to rebuild it there."""

    storage: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class _Moved:
    """What an offload moved; ``reloaded`` once ``reload_states`` brought it back."""

    storages: list[_Storage]
    leaves: dict[int, _Leaf]  # id of the stand-in in the held state -> where it goes back
    bytes_by_part: dict[str, int]
    file: str | None = None
    reloaded: bool = False


@dataclass(frozen=True, eq=False)
class OffloadedState:
    """A training state whose parts are off the compute device (``zf.offload_states``).

    ``device``: where they went (``"cpu"``: host memory; ``"nvme"``: ``file``); ``parts``: the parts
    chosen. A step, a checkpoint, ``gather_params`` and ``iter_weights`` refuse it, naming
    ``zf.reload_states``, which gives the ``State`` back; ``zf.memory_report`` says where each part is.
    """

    device: str
    parts: tuple[str, ...]
    file: str | None
    _held: State = field(repr=False)
    _moved: _Moved = field(repr=False)

    def __getattr__(self, name):  # only for names the dataclass does not hold: State's fields
        if name in ("params", "opt_state", "frozen", "buffers", "count", "plan", "loss_scale"):
            raise self.refusal()
        raise AttributeError(name)

    def refusal(self) -> StateOffloaded:
        """The error a use of this value raises (``Step._check`` raises it for a step)."""
        return StateOffloaded(
            f"this training state was moved off the device by zf.offload_states(device={self.device!r}): a "
            "step, a checkpoint, zf.gather_params or zf.iter_weights needs it back first: "
            "state = zf.reload_states(offloaded) (on an engine: engine.reload_states())")

    def close(self) -> None:
        """Give this value up without reloading it: its file goes, and the swap files of a state
        under ``offload_nvme`` (``State.close``)."""
        record = self._moved
        if not record.reloaded:
            record.reloaded = True
            record.storages.clear()
            if record.file is not None and os.path.exists(record.file):
                _remove_file(record.file)
        self._held.close()

    @property
    def moved_bytes(self) -> dict[str, int]:
        """Bytes this rank moved for each chosen part (0 where nothing of it was on the device)."""
        return dict(self._moved.bytes_by_part)

    def memory_report(self) -> dict:
        """``zf.memory_report`` of the state, with the moved bytes where they are now (``"disk"`` or
        the host), and ``"offloaded"``: the device, file and bytes moved for each part."""
        report = memory_report(self._held)
        moved = sum(self._moved.bytes_by_part.values())
        if self.device == "nvme":  # stand-ins on the meta device, which memory_report counts as the device's
            report["by_home"]["device"] -= moved
            report["by_home"]["disk"] += moved
        report["offloaded"] = {"device": self.device, "file": self.file, "moved_bytes": self.moved_bytes}
        return report


def offload_states(state: State, device: str = "cpu", path: str | None = None, include=None, *,
                   pin_memory: bool = True, non_blocking: bool = False) -> OffloadedState:
    """Move the parts of ``state`` that are on the compute device off it (module docstring).

    ``device``: ``"cpu"`` (host memory; page-locked if ``pin_memory``, on CUDA) or ``"nvme"`` (a file
    per rank in the folder ``path``, made if missing and removed
    again with the file when it made it). ``include``: the parts to move, by zfunc's names
    (``params``, ``frozen``, ``master``, ``optimizer``) or DeepSpeed's (``lp_params``, ``hp_params``,
    ``optim_states``; ``lp_grads`` and ``contiguous_grad_buffer`` name nothing, as zfunc keeps no
    gradient between steps); None: all. ``non_blocking``: the device-to-host copies of ``"cpu"``
    may still run on return (a reload waits for them). Use the returned value, and drop ``state``:
    ``state = zf.offload_states(state)``. A failure leaves ``state`` as it was, and no file.
    """
    device = getattr(device, "value", device)  # DeepSpeed's OffloadDeviceEnum
    if device not in DEVICES:
        raise ValueError(f"offload_states(device={device!r}): give 'cpu' (host memory) or 'nvme' (files under path=)")
    if device == "nvme" and path is None:
        raise ValueError("offload_states(device='nvme'): give path=, a folder on a fast disk (made if missing, as "
                         "offload_nvme makes its own), where each rank writes its state's parts to a file")
    parts = chosen(include)
    if isinstance(state, OffloadedState):
        raise ValueError("this state is offloaded already: reload it (zf.reload_states) before offloading it again")
    if not isinstance(state, State):
        raise TypeError(f"offload_states takes a zfunc State (from step.init), got {type(state).__name__}")
    if getattr(state, "_donated", False):
        raise ValueError("this state was donated to a step, which updated it in place; offload the state that "
                         "step returned")
    check_usable(state)  # a failed update, closed or broken swap files: refused, nothing moved
    store = swap.open_store(state)
    if store is not None:
        store.settle()  # the writes behind the last step are on disk
    home = dist.compute_device(state.params.spec.process_group)
    tensors = tensors_by_part(state)
    kept = {_key(t) for part, t in tensors if part not in parts and _holds_memory(t)}
    moving = [(part, t) for part, t in tensors if part in parts and t.device.type == home.type
              and _holds_memory(t) and _key(t) not in kept and (device == "nvme" or home.type != "cpu")]
    storages, index, leaves_at, by_part = [], {}, {}, dict.fromkeys(parts, 0)
    for part, t in moving:
        key = _key(t)
        if key not in index:
            index[key] = len(storages)
            storages.append(t.untyped_storage())
        leaves_at[id(t)] = _Leaf(index[key], t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        by_part[part] += t.numel() * t.element_size()
    moved, file = _copy_out(storages, device, path, pin_memory, non_blocking)
    stand_ins: dict[int, torch.Tensor] = {}
    record = _Moved(moved, {}, by_part, file)
    for part, t in moving:
        leaf = leaves_at[id(t)]
        stand_in = (torch.empty_strided(leaf.size, leaf.stride, dtype=leaf.dtype, device="meta") if device == "nvme"
                    else _view(moved[leaf.storage].host.untyped_storage(), leaf))
        stand_ins[id(t)] = stand_in
        record.leaves[id(stand_in)] = leaf
    held = map_tensors(state, lambda t: stand_ins.get(id(t), t))
    # the state given is used up: its moved tensors let go of their memory, and it refuses every use
    for _, t in moving:
        t.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage(), 0, (0,))
    del storages, moving, tensors
    mark_failed(state, _Refused(
        f"this state was given to zf.offload_states(device={device!r}), which moved its {', '.join(parts)} off "
        "the device: use the value it returned, and state = zf.reload_states(offloaded) to train on"))
    _release(state)
    return OffloadedState(device, parts, file, held, record)


def reload_states(offloaded: OffloadedState, *, non_blocking: bool = False) -> State:
    """The ``State`` ``offloaded`` stands for, its parts back on the device where they were, equal bit
    for bit; the file (``"nvme"``) is removed. ``non_blocking``: the host-to-device copies may still
    run on return (they are ordered before any later work on the device's stream). A failed read
    leaves ``offloaded`` and its file as they were, to try again."""
    if isinstance(offloaded, State):
        raise TypeError("reload_states takes the value zf.offload_states returned; this State is on its device "
                        "already")
    if not isinstance(offloaded, OffloadedState):
        raise TypeError(f"reload_states takes the value zf.offload_states returned, got {type(offloaded).__name__}")
    record = offloaded._moved
    if record.reloaded:
        raise ValueError("this offloaded state was reloaded already: use the State zf.reload_states returned")
    back = []
    for s in record.storages:
        target = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device)
        if s.host is not None:
            target.copy_(s.host, non_blocking=non_blocking and s.host.is_pinned())
        else:
            read_into(record.file, s.offset, target)
        back.append(target.untyped_storage())
    rebuilt = {pid: _view(back[leaf.storage], leaf) for pid, leaf in record.leaves.items()}
    state = map_tensors(offloaded._held, lambda t: rebuilt.get(id(t), t))
    record.reloaded = True
    for s in record.storages:
        if s.host is not None:
            host_buffers.give(s.host, _copies_done(s.device) if non_blocking else None)
    record.storages.clear()
    if record.file is not None:
        _remove_file(record.file)
    return state


def _copy_out(storages, device: str, path: str | None, pin: bool, non_blocking: bool):
    """Copy each storage out (host buffers, or one file); nothing is freed here. On failure, the
    buffers taken go back and the file is removed."""
    moved, taken, out = [], [], None
    try:
        if device == "nvme":
            make_marked(path)  # with its missing parents, as offload_nvme makes its own; removed with the file
            out = OffloadFile(path, dist.rank())
        for storage in storages:
            data = _bytes(storage)
            if out is not None:
                moved.append(_Storage(storage.nbytes(), storage.device, offset=out.append(data)))
            else:
                host = host_buffers.take(storage.nbytes(), pin=pin and torch.cuda.is_available())
                taken.append(host)
                host.copy_(data, non_blocking=non_blocking and host.is_pinned())
                moved.append(_Storage(storage.nbytes(), storage.device, host=host))
        return moved, None if out is None else out.commit()
    except BaseException:
        if out is not None:
            out.discard()
        if device == "nvme" and os.path.isdir(path):
            remove_made(path)
        for host in taken:
            host_buffers.give(host)
        raise


def _remove_file(file: str) -> None:
    """Remove an offload's file, and the folders it made for it once they are empty."""
    os.remove(file)
    remove_made(os.path.dirname(file))


def _release(state) -> None:
    """Give the freed memory back: the coordinators' last passes over this model (they hold its units
    until the next step), zfunc's host block cache and the C heap, and CUDA's cache."""
    coordinator.release_passes(state.params.spec.model)
    buffers.clear()
    buffers.trim()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _copies_done(device: torch.device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _holds_memory(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and t.untyped_storage().nbytes() > 0


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view(storage: torch.UntypedStorage, leaf: _Leaf) -> torch.Tensor:
    return torch.empty(0, dtype=leaf.dtype, device=storage.device).set_(storage, leaf.offset, leaf.size, leaf.stride)


__all__ = ["DEVICES", "PARTS", "OffloadedState", "StateOffloaded", "offload_states", "reload_states"]
