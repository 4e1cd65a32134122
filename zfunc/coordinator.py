"""The coordinator: record the order units are materialized in, then prefetch along it.

A unit's life in a step (zfunc/materialize.py does each arrow; this module
decides when the first one starts)::

    home: on disk / in RAM, this rank's shard or replicated
      |  prefetch (read from disk, then all-gather), issued ahead along the trace
      v
    full flat buffer, gathered --> used by forward (or by backward's re-gather)
      |  released after use (the root and the unit forward used last are kept for backward)
      v
    given back to the pool; its gradient goes home as backward finishes with it

The first step through a ``Coordinator`` records the trace: every
materialization, forward and backward re-gathers alike, as (unit, elements).
Later steps follow it: at each materialization the coordinator issues the next
units' reads and all-gathers, up to ``prefetch_bucket_size`` elements ahead,
while the gathered and in-flight elements stay within ``max_live_parameters``.
Every rank follows the same trace with the same budget, so every rank issues
the same collectives in the same order.

A step that departs from the trace (control flow that skips a block) goes on
with whichever known trace matches what it did so far, or on demand, and its
order is recorded as a new trace, with one warning per distinct new order; a
model that alternates between two paths settles on both with no further
messages. ``metrics["prefetch"]`` reports each step's hits (materializations
that found their buffer already in flight), misses, bytes prefetched, seconds
spent waiting for materializations, and the most gathered elements alive at
once.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import time
import warnings
from dataclasses import dataclass

DEFAULT_PREFETCH_BUCKET_SIZE = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters


class OrderChangedWarning(UserWarning):
    """A step materialized units in an order not seen before; it was recorded."""


@dataclass(frozen=True)
class Prefetch:
    """How far ahead to materialize: ``bucket_size`` elements ahead of use (0: on demand only),
    never more than ``max_live`` elements gathered or in flight at once."""

    bucket_size: int = DEFAULT_PREFETCH_BUCKET_SIZE
    max_live: int = DEFAULT_MAX_LIVE_PARAMETERS

    def __post_init__(self):
        for name in ("bucket_size", "max_live"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of elements, got {value!r}")
        object.__setattr__(self, "bucket_size", int(self.bucket_size))
        object.__setattr__(self, "max_live", int(self.max_live))


def prefetch_settings(bucket_size: int | None, max_live: int | None) -> Prefetch | None:
    """The settings given to a transform (``zero3``, ``offload_nvme``), or None if it was given none."""
    if bucket_size is None and max_live is None:
        return None
    default = Prefetch()
    return Prefetch(default.bucket_size if bucket_size is None else bucket_size,
                    default.max_live if max_live is None else max_live)


class Coordinator:
    """One per step function: the traces it has seen, and its settings. It changes when
    materializations start, never what they compute."""

    def __init__(self, settings: Prefetch):
        self.settings = settings
        self.traces: dict[str, tuple] = {}  # fingerprint -> trace (tuple of (unit key, elements))
        self.latest: tuple | None = None  # the trace the next step starts by following

    def begin(self) -> "Run":
        return Run(self)

    def known(self, prefix: list) -> tuple | None:
        """A known trace that starts with ``prefix`` (the latest first)."""
        candidates = ([self.latest] if self.latest else []) + list(self.traces.values())
        n = len(prefix)
        return next((t for t in candidates if len(t) >= n and list(t[:n]) == prefix), None)

    def record(self, events: list) -> None:
        trace = tuple(events)
        key = fingerprint(trace)
        if key not in self.traces:
            if self.traces:
                warnings.warn(
                    f"units were materialized in an order not seen before ({len(trace)} materializations; "
                    f"{len(self.traces)} order(s) known): this step ran on demand from the first difference "
                    "and its order is recorded, so it is prefetched the next time it recurs. Expected once per "
                    "distinct order (data-dependent control flow); on every step it means the order never repeats",
                    OrderChangedWarning, stacklevel=4)
            self.traces[key] = trace
        self.latest = trace


def fingerprint(trace) -> str:
    return hashlib.blake2b(repr(trace).encode(), digest_size=8).hexdigest()


class Run:
    """One step's (or micro-batch's) pass through the units: follows a trace, records the order."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.settings = coordinator.settings
        self.events: list = []  # (unit key, elements), in the order materialized
        self.trace = coordinator.latest  # being followed; None once off every known trace
        self.units: dict = {}  # unit key -> _Unit, as they are registered
        self.live = 0  # elements gathered or in flight now
        self.peak_live = 0
        self.hits = self.misses = 0
        self.prefetched_bytes = 0
        self.wait_s = 0.0

    # -------------------------------------------------------------- units tell us

    def register(self, unit) -> None:
        self.units[unit.key] = unit

    def start(self) -> None:
        """Before the first materialization: prefetch the start of the trace."""
        self._prefetch(0)

    def using(self, unit) -> None:
        """``unit`` is about to be materialized (forward, or a backward re-gather)."""
        event = (unit.key, unit.full_numel)
        self.events.append(event)
        n = len(self.events)
        if self.trace is not None and (len(self.trace) < n or self.trace[n - 1] != event):
            self.trace = self.coordinator.known(self.events)
        if unit.pending is not None:
            self.hits += 1
        else:
            self.misses += 1
        self._prefetch(n)

    def allocated(self, numel: int) -> None:
        self.live += numel
        self.peak_live = max(self.peak_live, self.live)

    def freed(self, numel: int) -> None:
        self.live -= numel
        self._prefetch(len(self.events))  # room under max_live again

    @contextlib.contextmanager
    def waiting(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- prefetch

    def _prefetch(self, position: int) -> None:
        """Issue materializations for the trace from ``position`` on, within the budgets.

        Each unit counts at its next use only; one already in flight counts
        against the bucket, one still gathered is skipped (its later use is
        prefetched once it is released).
        """
        if self.trace is None or self.settings.bucket_size <= 0:
            return
        ahead, seen = 0, set()
        for key, numel in self.trace[position:]:
            if key in seen:
                continue
            seen.add(key)
            unit = self.units.get(key)
            if unit is None:
                continue
            if unit.pending is not None:
                ahead += numel
                continue
            if unit.tracker.holds(unit):
                continue
            if ahead + numel > self.settings.bucket_size or self.live + numel > self.settings.max_live:
                return
            unit.prefetch()
            self.prefetched_bytes += unit.pending.out.numel() * unit.pending.out.element_size()
            ahead += numel

    # ------------------------------------------------------------------ finish

    def finish(self) -> dict:
        """Record this pass's order; its prefetch metrics."""
        if self.events:
            self.coordinator.record(self.events)
        return {"hits": self.hits, "misses": self.misses, "bytes_prefetched": self.prefetched_bytes,
                "wait_s": self.wait_s, "max_live_elements": self.peak_live}


_current: contextvars.ContextVar[Coordinator | None] = contextvars.ContextVar("zfunc_coordinator", default=None)


@contextlib.contextmanager
def active(coordinator: Coordinator | None):
    """Materializations inside follow ``coordinator`` (None: on demand)."""
    token = _current.set(coordinator)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Coordinator | None:
    return _current.get()


def merge(metrics: list[dict]) -> dict:
    """One step's metrics from its passes (micro-batches)."""
    if not metrics:
        return {"hits": 0, "misses": 0, "bytes_prefetched": 0, "wait_s": 0.0, "max_live_elements": 0}
    out = {k: sum(m[k] for m in metrics) for k in ("hits", "misses", "bytes_prefetched", "wait_s")}
    out["max_live_elements"] = max(m["max_live_elements"] for m in metrics)
    return out
