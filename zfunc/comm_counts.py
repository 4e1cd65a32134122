"""How many collectives this process issued, and how many bytes they moved: ``metrics["comm"]``.

zfunc.dist issues every collective and tells this module about each (``count``); a step takes a
``mark`` when it begins and reports what came ``since``; ``counting`` does the same around any
code. Counts are per group label (``label_group``: "world", or a mesh dim's "shard",
"replicate", hpZ's "secondary") and per kind. Bytes follow nccl-tests: an all-gather's gathered
output, a reduce-scatter's full input, the tensor of the rest.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.distributed as dist

# The kinds counted. Data: what moves the model's tensors. Control: "agreement", the vectors ranks
# agree on (the step's agreement, flags, the coordinator's lockstep check), and "barrier"; the
# store's traffic (heartbeats, ``dist.exchange``) is not counted.
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send", "recv", "agreement", "barrier")

_totals: dict[tuple[str, str], list[int]] = {}  # (group label, kind) -> [calls, bytes] since the process began
_totals_lock = threading.Lock()  # collectives may be issued from worker threads
_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its label


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def label_group(group, name: str) -> None:
    """Count ``group``'s collectives under ``name`` (e.g. a mesh dim's, ``"shard"``) in
    ``metrics["comm"]``. The default group is ``"world"``; an unlabelled one is named by its global
    ranks, ``"ranks(0,2)"``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"label_group: the label must be a non-empty string, got {name!r}")
    if group is None or (_initialized() and group is dist.group.WORLD):
        raise ValueError("label_group: the default group is always counted as 'world'; label a subgroup "
                         "(dist.new_group, a DeviceMesh dim's get_group())")
    _names[group] = name


def group_label(group=None) -> str:
    """The name ``group``'s collectives are counted under (see ``label_group``)."""
    if group is None or not _initialized() or group is dist.group.WORLD:
        return "world"
    name = _names.get(group)
    if name is None:
        name = _names[group] = f"ranks({','.join(map(str, dist.get_process_group_ranks(group)))})"
    return name


def count(kind: str, group, nbytes: int) -> None:
    """One collective of ``kind`` over ``group`` moving a buffer of ``nbytes`` (no sync: a dict add)."""
    key = (group_label(group), kind)
    with _totals_lock:
        c = _totals.get(key)
        if c is None:
            _totals[key] = [1, nbytes]
        else:
            c[0] += 1
            c[1] += nbytes


def nbytes(t: torch.Tensor, numel: int | None = None) -> int:
    """The bytes of ``t``, or of ``numel`` elements of its dtype."""
    return (t.numel() if numel is None else numel) * t.element_size()


def comm_mark() -> dict[tuple[str, str], tuple[int, int]]:
    """The counts so far, for ``comm_since`` (cheap: a copy of a few entries)."""
    with _totals_lock:
        return {k: (c[0], c[1]) for k, c in _totals.items()}


def comm_since(mark: dict) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives issued since ``mark`` (``comm_mark``), in every thread of this process:
    ``{group label: {kind: {"calls": n, "bytes": b}}}``, kinds with no call left out."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (label, kind), (calls, moved) in comm_mark().items():
        calls0, moved0 = mark.get((label, kind), (0, 0))
        if calls > calls0:
            out.setdefault(label, {})[kind] = {"calls": calls - calls0, "bytes": moved - moved0}
    return out


@contextlib.contextmanager
def counting():
    """Count the collectives issued inside: yields a dict that, on exit, holds them as
    ``metrics["comm"]`` does (``comm_since``). Steps and threads running meanwhile count too."""
    counts: dict = {}
    mark = comm_mark()
    try:
        yield counts
    finally:
        counts.update(comm_since(mark))
