"""The coordinator: record the order units are materialized in, then prefetch along it.

A unit's life in a step (zfunc/materialize.py does each arrow; this module
decides when the first one starts and whether the last one waits)::

    on disk (offload_nvme's swap file)
      |  read into a swap-pool buffer        } issued ahead along the trace, within
      v                                      } prefetch_bucket_size and max_live_parameters
    in RAM: this rank's shard (or the whole unit, replicated; offload_cpu(params=True): in
      |  host memory, copied to the device first, even at W = 1)
      |  all-gather if sharded
      v
    gathered: the full flat buffer --> used by forward, or by backward's re-gather
      |  released after use, unless the trace uses it again within max_reuse_distance
      |  elements (then kept: the next use is a hit); the root and the unit forward
      |  used last are kept for backward
      v
    given back to its pool; its gradient goes home as backward finishes with it

The first step through a ``Coordinator`` records the trace: every
materialization that gathers, reads or copies in, forward and backward re-gathers alike,
as (unit, elements), and every reduction of a gradient over the ranks. Later steps follow it: at each materialization, and when a
buffer is freed, the coordinator issues the next units' reads and all-gathers,
up to ``prefetch_bucket_size`` elements ahead (default twice the largest unit,
so memory stays at ZeRO-3's formula plus a few units), while the gathered and
in-flight elements stay within ``max_live_parameters`` and a read ahead leaves
the swap pool a buffer. Every rank follows the same trace with the same budget,
so every rank issues the same collectives in the same order.

A step that departs from the trace (control flow that skips a block) goes on
with a known trace that matches what it did so far, or on demand, and its order
is recorded, with one ``OrderChangedWarning`` per order not seen before; the
next pass expects the order that followed the last one last time, so a model
that alternates between two paths prefetches both with no further messages.

Ranks must materialize the same units in the same order, and no rank may ever
issue a collective whose size differs from its peers' (gloo aborts the process,
nccl hangs or reads garbage). So every collective of a step passes the
coordinator's gate (zfunc.dist) before it is issued, and the order of a step's
events (materializations and gradient reductions) is kept in step:

* while no order is agreed (a pass with no trace to follow: the recording
  step, or a new path), each collective is first checked: one fixed-size
  all-gather of its size and identity; if any rank's differs, none issues it;
* a pass that follows a trace (agreed: every rank recorded it in a step that
  passed) issues its collectives unchecked, at no cost, and compares each event
  with the trace locally. A rank that departs from it (or ends early) issues
  nothing more: it posts where it departed to the store; if every rank departed
  alike (control flow that agrees across ranks) they go on, checking; if not, a
  rank still waiting on a collective the departed rank will never issue sees the
  post within a slice of its wait (gloo; elsewhere at the timeout), and every
  rank raises;
* the step's one all-reduce (zfunc.step) carries a fingerprint of the order.

Every collective a step issues has a timeout (``collective_timeout``). On any of
these failures, or a failed collective, the ranks exchange their orders through
the process group's store (not a collective, so it works while collectives
hang) and every rank raises ``RanksDivergedError`` naming each rank's event
where the orders first differ; a rank that neither reports nor waits in a
collective (its heartbeat is still; zfunc.dist) is named in a
``RankUnresponsiveError``: stopped, stuck outside the step, or dead.

``metrics["prefetch"]`` reports each step's hits (materializations that found
their buffer in flight or kept), misses, bytes prefetched, seconds spent
waiting for materializations, and the most gathered elements alive at once.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import time
import warnings
import weakref
from dataclasses import dataclass

from . import dist

DEFAULT_PREFETCH_BUCKET_SIZE = None  # twice the largest unit (DeepSpeed's 5e7 gathers most of a small model)
DEEPSPEED_PREFETCH_BUCKET_SIZE = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size, for its configs
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters
DEFAULT_MAX_REUSE_DISTANCE = 0  # release after use (DeepSpeed's default, 1e9, keeps most of a small model)
DEFAULT_TIMEOUT_S = 300.0  # a collective not done by then means the ranks diverged


class OrderChangedWarning(UserWarning):
    """A step materialized units in an order not seen before; it was recorded."""


class RanksDivergedError(RuntimeError):
    """Ranks materialized different units in one step; raised on every rank."""


class RankUnresponsiveError(RanksDivergedError):
    """A rank did not arrive at a step's collectives and does not wait in one: it is stopped,
    stuck outside the step (a hung data loader), or dead; raised on the ranks that waited."""


_step_ids = itertools.count()  # every rank begins the same steps in the same order: store keys per step


@dataclass(frozen=True)
class Prefetch:
    """The coordinator's budgets, in elements: materialize up to ``bucket_size`` ahead of use
    (0: on demand only; None: twice the model's largest unit), never more than ``max_live`` gathered or in flight at once; keep a
    released unit whose next use is within ``max_reuse`` elements of materializations.
    ``timeout_s``: how long a step's collective may take before the step says which ranks
    diverged (None: forever)."""

    bucket_size: int | None = DEFAULT_PREFETCH_BUCKET_SIZE
    max_live: int = DEFAULT_MAX_LIVE_PARAMETERS
    max_reuse: int = DEFAULT_MAX_REUSE_DISTANCE
    timeout_s: float | None = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        for name in ("bucket_size", "max_live", "max_reuse"):
            value = getattr(self, name)
            if value is None and name == "bucket_size":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of elements, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"collective_timeout must be a positive number of seconds or None, got {self.timeout_s!r}")


_NAMES = {"bucket_size": "prefetch_bucket_size", "max_live": "max_live_parameters",
          "max_reuse": "max_reuse_distance", "timeout_s": "collective_timeout"}


def prefetch_settings(**given) -> Prefetch | None:
    """The settings a transform (``zero3``, ``offload_nvme``) was given by their public names
    (``prefetch_bucket_size``, ``max_live_parameters``, ``max_reuse_distance``,
    ``collective_timeout``), defaults for the rest; None if it was given none."""
    fields = {field: given[public] for field, public in _NAMES.items() if given.get(public) is not None}
    return Prefetch(**fields) if fields else None


class Traces:
    """The orders seen for one model layout, and the one the next pass starts by following."""

    def __init__(self, model):
        self.model = model  # held, so its id is not reused by another layout
        self.by_fingerprint: dict[str, tuple] = {}  # fingerprint -> trace (tuple of (unit key, elements))
        self.latest: str | None = None  # the fingerprint of the last pass's order
        self.successor: dict[str, str] = {}  # fingerprint -> the order that came after it last time

    def expected(self) -> tuple | None:
        """The order the next pass is expected to take: the one that followed the last pass's
        order last time (so paths that alternate are each prefetched), else that order again."""
        if self.latest is None:
            return None
        return self.by_fingerprint[self.successor.get(self.latest, self.latest)]

    def known(self, prefix: list) -> tuple | None:
        """A known trace that starts with ``prefix``."""
        n = len(prefix)
        return next((t for t in self.by_fingerprint.values() if len(t) >= n and list(t[:n]) == prefix), None)

    def record(self, events: list) -> None:
        trace = tuple(events)
        key = fingerprint(trace)
        if key not in self.by_fingerprint:
            if self.by_fingerprint:
                warnings.warn(
                    f"units were materialized in an order not seen before ({len(trace)} materializations; "
                    f"{len(self.by_fingerprint)} order(s) known): this step ran on demand from the first "
                    "difference and its order is recorded, so it is prefetched the next time it recurs. "
                    "Expected once per distinct order (data-dependent control flow); on every step it means "
                    "the order never repeats", OrderChangedWarning, stacklevel=5)
            self.by_fingerprint[key] = trace
        if self.latest is not None:
            self.successor[self.latest] = key
        self.latest = key


class Coordinator:
    """One per step function: the traces it has seen (per model layout), and its settings.
    It changes when materializations start, never what they compute; inside a step
    (``begin_step``) it is also the gate of the step's collectives (module docstring)."""

    def __init__(self, settings: Prefetch):
        _coordinators.add(self)
        self.settings = settings
        self.layouts: dict[int, Traces] = {}  # id of a ModelSpec -> its traces
        self.runs: list[Run] = []  # this step's passes (micro-batches)
        self.step_id: int | None = None  # names this step's keys in the store
        self.lockstep = False  # inside a step: collectives are kept in step with the other ranks'
        self.checking = False  # each collective is checked with the other ranks before it is issued
        self.issued = 0  # collectives this step has issued through the gate
        self.posted: list[str] = []  # this rank's posts to the store in this step (forgotten at the next)

    def begin_step(self) -> None:
        # every rank passed the last step's one all-reduce, so all have read what this one posted
        dist.forget(self.posted)
        self.posted = []
        self.runs = []
        self.step_id = next(_step_ids)
        self.lockstep = True
        self.checking = False  # every rank starts a step in the same place (the last one agreed)
        self.issued = 0

    def begin(self, model) -> "Run":
        """A pass over the units of ``model`` (a ModelSpec)."""
        traces = self.layouts.get(id(model))
        if traces is None:
            traces = self.layouts[id(model)] = Traces(model)
        run = Run(self, traces, len(self.runs))
        self.runs.append(run)
        return run

    def order(self) -> list[str]:
        """The units this step materialized (and whose gradients it reduced), in order, by name."""
        return [run.name(key) for run in self.runs for key, _ in run.events]

    def order_hash(self) -> int:
        """A 20-bit fingerprint of this step's order: ranks compare sums of it and of its square
        in the step's one float64 all-reduce (equal on every rank iff W * sum(h^2) == sum(h)^2)."""
        return int(fingerprint(tuple(key for run in self.runs for key, _ in run.events)), 16) & 0xFFFFF

    # ------------------------------------------------------------------- the gate

    def admit(self, op: str, t, group) -> int:
        """``op`` over ``t`` is about to be issued (zfunc.dist): while checking, every rank first
        shows the others its size and identity. Returns its place in this step's collectives."""
        if self.checking:
            self.check(dist.identity(op, t), group)
        self.issued += 1
        return self.issued - 1

    def check(self, identity: tuple[int, int], group) -> None:
        if not dist.same_everywhere(identity, group):
            raise _Mismatch("the ranks' next collectives differ (each rank checked its own before issuing it)")

    def stalled(self, seq: int, group) -> None:
        """This rank has waited a slice for collective ``seq``: raise if another rank left the
        agreed order before issuing it (it never will)."""
        for r, posted in enumerate(dist.peek(f"{self.step_id}/left", group)):
            if posted is not None and int(posted) <= seq:
                raise dist.OutOfStep(f"rank {r} left the agreed order after {posted} collectives of this step; "
                                     f"this rank waited on collective {seq + 1}")

    def depart(self, run: "Run", what: str, group) -> None:
        """``run`` left the trace every rank agreed on (``what`` it did instead); it issues nothing
        until every rank's post says they left it alike (then they go on, checking each collective)."""
        dist.post(f"{self.step_id}/left", str(self.issued), group)
        timeout = self.settings.timeout_s
        posted = dist.exchange(f"{self.step_id}/depart/{run.index}", f"{len(run.events)}: {what}", group,
                               timeout_s=float("inf") if timeout is None else timeout,
                               give_up=lambda: any(p is not None for p in dist.peek(f"{self.step_id}/order", group)))
        if len(set(posted)) > 1 or None in posted:
            raise dist.OutOfStep(f"this rank left the agreed order of units ({what}); the others did not alike")
        # every rank left alike: its collectives go on (checked, so none is issued before every rank
        # is past this point, and none is then taken for one the others will not issue)
        dist.forget([f"{self.step_id}/left"])
        self.posted.append(f"{self.step_id}/depart/{run.index}")
        self.checking = True

    # ------------------------------------------------------------- failures

    def diverged(self, group, cause: BaseException | None = None):
        """Raise, on every rank, which unit each rank materialized where the orders first differ;
        or, if some rank neither reports nor waits in a collective, that it is stuck or dead.

        The orders travel through the process group's store, so this works while collectives hang.
        """
        mine = self.order()
        timeout = self.settings.timeout_s or 30.0
        try:
            dist.post(f"{self.step_id}/left", str(self.issued), group)  # it issues nothing more
            posted = dist.exchange(f"{self.step_id}/order", "\n".join(mine), group, timeout_s=2 * timeout,
                                   grace_s=dist.grace_s(timeout, group))
        except (RuntimeError, OSError) as e:
            raise RanksDivergedError(
                f"the ranks could not compare their orders: the process group's store failed ({e}); the rank "
                "that hosts it (rank 0 under torchrun's TCP store) may have died") from (cause or e)
        missing = [r for r, p in enumerate(posted) if p is None]
        if missing:
            ranks = ", ".join(map(str, missing))
            failed = cause is not None and not isinstance(cause, dist.CollectiveTimeout)
            s = "s" if len(missing) > 1 else ""
            raise RankUnresponsiveError(
                f"rank{s} {ranks} did not arrive: "
                + (f"a collective failed ({str(cause).strip().split('. ')[0]})" if failed else
                   f"a collective did not complete within {timeout:g} s")
                + f", and rank{s} {ranks} neither reported nor waited in a collective: "
                + ("probably dead (or stuck: stopped, a hung data loader)" if failed else
                   "stuck (stopped, a hung data loader, a long computation outside the step) or dead")
                + "; its own log says which. The process group cannot be used after this: restart the job"
            ) from cause
        if cause is not None and not isinstance(cause, dist.CollectiveTimeout):
            raise cause  # every rank is here: the failure is what it says
        orders = [p.split("\n") if p else [] for p in posted]
        n = max(len(o) for o in orders)
        at = next((i for i in range(n) if len({o[i] if i < len(o) else None for o in orders}) > 1), n)
        where = ", ".join(f"rank {r}: " + (repr(o[at]) if at < len(o) else "nothing (its step ended there)")
                          for r, o in enumerate(orders))
        if isinstance(cause, dist.OutOfStep):
            what = "found before any rank issued a collective that did not match"
        elif cause is not None:
            what = f"a collective timed out after {timeout:g} s"
        else:
            what = "their orders' fingerprints differ"
        if at == n:
            raise RanksDivergedError(
                f"{what}, yet every rank materialized the same {n} units in the same order: a rank failed "
                "or stalled outside materialization (its own error says why)") from cause
        usable = cause is None or isinstance(cause, _Mismatch)  # no rank issued what the others did not
        raise RanksDivergedError(
            f"ranks materialized different units in this step ({what}): at event {at + 1} of this "
            f"rank's {len(mine)} (materializations and gradient reductions), {where}. Every rank must run the "
            "same modules in the same order (control flow that depends on the data must agree across ranks)"
            + ("" if usable else "; the process group cannot be used after this: restart the job")
        ) from cause


class _Mismatch(dist.OutOfStep):
    """A check found the ranks' next collectives differ: every rank stopped at the same one."""


def fingerprint(trace) -> str:
    return hashlib.blake2b(repr(trace).encode(), digest_size=8).hexdigest()


class Run:
    """One step's (or micro-batch's) pass through the units: follows a trace, records the order.

    Its events are the units' materializations, ``(unit key, elements)``, and their gradients'
    reductions, ``(("g", *unit key), elements)``: every collective it issues follows from them."""

    def __init__(self, coordinator: Coordinator, traces: Traces, index: int = 0):
        self.coordinator = coordinator
        self.traces = traces
        self.index = index  # the step's passes before this one
        self.settings = coordinator.settings
        self.events: list = []  # (key, elements), in the order they happened
        self.trace = traces.expected()  # being followed; None once off every known trace
        # in a step, a pass with a trace follows the order every rank agreed on, unchecked; one
        # without (recording) checks each collective with the other ranks before issuing it
        self.following = coordinator.lockstep and self.trace is not None
        if coordinator.lockstep:
            coordinator.checking = self.trace is None
        self.group = None  # the units' process group
        self.units: dict = {}  # unit key -> _Unit that gathers, as they are registered
        self.names: dict = {}  # unit key -> the unit's name, for errors
        self.live = 0  # elements gathered or in flight now
        self.peak_live = 0
        self.hits = self.misses = 0
        self.prefetched_bytes = 0
        self.wait_s = 0.0
        self.bucket = 0  # elements to prefetch ahead; set by start()

    # -------------------------------------------------------------- units tell us

    def register(self, unit, name: str) -> None:
        """A unit of this pass; prefetched if materializing it gathers or reads."""
        if unit.gathers:
            self.units[unit.key] = unit
        self.names[unit.key] = name
        self.group = unit.group

    def name(self, key) -> str:
        if key[0] == "g":
            return f"{self.names.get(key[1:], str(key[1:]))} (gradient)"
        return self.names.get(key, str(key))

    def keeps(self, unit) -> bool:
        """Whether ``unit``, done with now, is materialized again within ``max_reuse``
        elements of other materializations along the trace (then it stays gathered)."""
        if self.trace is None:
            return False
        distance = 0
        for key, numel in self.trace[len(self.events):]:
            if key == unit.key:
                return True
            if key[0] == "g":
                continue
            distance += numel
            if distance > self.settings.max_reuse:
                return False
        return False

    def start(self) -> None:
        """Once every unit is registered, before the first materialization: the bucket (default
        twice the largest unit), then prefetch the start of the trace."""
        bucket = self.settings.bucket_size
        self.bucket = 2 * max((u.full_numel for u in self.units.values()), default=0) if bucket is None else bucket
        self._prefetch(0)

    def using(self, unit) -> None:
        """``unit`` is about to be materialized (forward, or a backward re-gather)."""
        self._happens((unit.key, unit.full_numel))
        n = len(self.events)
        if unit.pending is not None:
            self.hits += 1
        else:
            self.misses += 1
        self._prefetch(n)

    def sending_home(self, unit) -> None:
        """``unit``'s gradient is about to be reduced over the ranks."""
        self._happens((("g", *unit.key), unit.full_numel))

    def _happens(self, event) -> None:
        """Record ``event`` before any collective it leads to; off the trace, find another (or none),
        and in a step, first agree with the other ranks that they left it alike."""
        self.events.append(event)
        n = len(self.events)
        if self.trace is not None and (len(self.trace) < n or self.trace[n - 1] != event):
            if self.following:
                self.following = False
                self.coordinator.depart(self, self.name(event[0]), self.group)
            self.trace = self.traces.known(self.events)

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
        bucket = self.bucket
        if self.trace is None or bucket <= 0:
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
            if (ahead + numel > bucket or self.live + numel > self.settings.max_live
                    or not unit.can_prefetch()):
                return
            unit.prefetch()
            self.prefetched_bytes += unit.pending.out.numel() * unit.pending.out.element_size()
            ahead += numel

    # ------------------------------------------------------------------ finish

    def finish(self) -> dict:
        """Record this pass's order; its prefetch metrics. In a step, the ranks end it together:
        one that ends before its trace does departs from it, and while checking, the end is checked."""
        if self.following and len(self.events) != len(self.trace):
            self.following = False
            self.coordinator.depart(self, "the end of its pass", self.group)
        if self.coordinator.checking and dist.world_size(self.group) > 1:
            self.coordinator.check((-1, len(self.events)), self.group)
        if self.events:
            self.traces.record(self.events)
        return {"hits": self.hits, "misses": self.misses, "bytes_prefetched": self.prefetched_bytes,
                "wait_s": self.wait_s, "max_live_elements": self.peak_live}


_coordinators: "weakref.WeakSet[Coordinator]" = weakref.WeakSet()  # every live one, for release_passes


def release_passes(model) -> None:
    """Drop every coordinator's last step's passes over ``model`` (a ModelSpec). Between steps they
    only wait for the next ``begin_step`` to clear them, holding the units they registered (and so
    each rank's parameter shards, at W > 1); ``zf.offload_states`` lets that memory go now."""
    for c in list(_coordinators):
        if any(run.traces.model is model for run in c.runs):
            c.runs = []


_current: contextvars.ContextVar[Coordinator | None] = contextvars.ContextVar("zfunc_coordinator", default=None)


@contextlib.contextmanager
def active(coordinator: Coordinator | None):
    """Materializations inside follow ``coordinator`` (None: on demand); inside a step
    (``begin_step``), collectives pass its gate."""
    token = _current.set(coordinator)
    try:
        with dist.gated(coordinator if coordinator is not None and coordinator.lockstep else None):
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
