"""Process groups and the few collectives zfunc uses, all in one place.

W = 1 needs no process group at all. Under torchrun, ``init()`` reads the
environment and picks gloo on CPU, nccl on CUDA. Every collective in the
library goes through this module, so the torch API it depends on lives here.

Inside a step, every collective is first shown to the step's gate (``gated``:
the coordinator, which may check with the other ranks that theirs is the same
before any rank issues it) and waited for at most the step's ``deadline``; a
wait longer than a slice beats the rank's heartbeat in the store, so the other
ranks can tell a rank that is stuck or dead from one that waits with them.

Every collective issued here is also counted (zfunc.comm_counts, whose names this module
re-exports: ``counting``, ``label_group``, ``comm_mark``/``comm_since``: ``metrics["comm"]``).
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import gc
import hashlib
import os
import time

import torch
import torch.distributed as dist

from . import buffers, layout
from .comm_counts import count as _count, nbytes as _nbytes
from .comm_counts import KINDS, comm_mark, comm_since, counting, group_label, label_group  # noqa: F401 (zf.dist's names)

_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar("zfunc_collective_timeout", default=None)
_gate: contextvars.ContextVar = contextvars.ContextVar("zfunc_collective_gate", default=None)
_label: contextvars.ContextVar[str] = contextvars.ContextVar("zfunc_collective_label", default="")
_watched: contextvars.ContextVar = contextvars.ContextVar("zfunc_watched_group", default=None)


def _all_gather_single(out, inp, group=None, async_op=False):
    """torch >= 2.13's name; torch 2.11 (the GPU machines') has only ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out, inp, group=None, async_op=False):
    """As above: ``reduce_scatter_tensor`` before torch 2.13."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the step's timeout (another rank is elsewhere)."""


class CollectiveFailed(dist.DistBackendError):
    """A collective failed (gloo: a peer's connection was reset or closed: that rank probably died)."""


class OutOfStep(CollectiveTimeout):
    """The ranks' next collectives differ (found before any rank issued one that would not match)."""


@contextlib.contextmanager
def deadline(seconds: float | None, group=None):
    """Collectives waited for inside raise ``CollectiveTimeout`` after ``seconds`` (None: wait forever);
    a long wait watches the heartbeats of ``group``'s ranks."""
    tokens = _timeout.set(seconds), _watched.set(group)
    try:
        yield
    finally:
        _timeout.reset(tokens[0])
        _watched.reset(tokens[1])


@contextlib.contextmanager
def gated(gate):
    """Collectives issued inside call ``gate.admit(op, tensor, group)`` first (None: no gate)."""
    token = _gate.set(gate)
    try:
        yield
    finally:
        _gate.reset(token)


@contextlib.contextmanager
def labelled(label: str):
    """Collectives issued inside are about ``label`` (a unit's name): part of their identity."""
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


def _admit(op: str, t: torch.Tensor, group) -> int | None:
    """Show the gate ``op`` over ``t`` before it is issued; its place in the step's collectives."""
    gate = _gate.get()
    return None if gate is None else gate.admit(op, t, group)


def identity(op: str, t: torch.Tensor) -> tuple[int, int]:
    """What must be the same on every rank for a collective to match: its size, and a digest of
    its kind, dtype and label."""
    digest = hashlib.blake2b(f"{op}|{t.dtype}|{_label.get()}".encode(), digest_size=8).digest()
    return t.numel(), int.from_bytes(digest, "little", signed=True)


def same_everywhere(values: tuple[int, ...], group=None) -> bool:
    """Whether every rank of ``group`` passed the same ``values``: one all-gather of a fixed size
    (so it matches whatever the others passed), issued around the gate."""
    mine = torch.tensor(values, dtype=torch.int64, device=device_of(group))
    rows = torch.empty(world_size(group) * mine.numel(), dtype=torch.int64, device=mine.device)
    _count("agreement", group, _nbytes(rows))
    _wait(_all_gather_single(rows, mine, group=group, async_op=True))
    rows = rows.view(-1, mine.numel()).cpu()
    return bool((rows == rows[0]).all())


# ------------------------------------------------------------------ waiting, heartbeats


def _slice_s(seconds: float) -> float:
    """How long one wait lasts before the rank beats and looks again."""
    return min(1.0, max(0.05, seconds / 20))


def _wait(work, seq: int | None = None) -> None:
    """Wait for ``work`` within the deadline; each slice of a long wait beats the heartbeat and
    asks the gate whether collective ``seq`` of the step can still complete (``stalled``)."""
    seconds = _timeout.get()
    group = _watched.get()
    backend = None if seconds is None else dist.get_backend(group)
    if seconds is None or backend == "nccl":
        # nccl: a timed wait blocks the host until the GPU is done (a sync on every gather);
        # an untimed one only orders the streams, and nccl's watchdog (the process group's
        # timeout) tears a stuck collective down
        work.wait()
        return
    # gloo's timed wait leaves the collective running, so it is waited for in slices with a
    # heartbeat between; other backends wait once
    step = _slice_s(seconds) if backend == "gloo" else seconds
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(min(step, left), 0.001)))
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise e if isinstance(e, dist.DistError) else CollectiveFailed(str(e)) from e
        if end - time.monotonic() <= 0:
            raise CollectiveTimeout(
                f"a collective did not complete within {seconds:g} s: another rank is not taking part in it "
                "(it diverged, failed or is much slower). The process group cannot be used after this")
        beat(group, watch=end - time.monotonic() < 4 * step, step=step)
        gate = _gate.get()
        if gate is not None and seq is not None:
            gate.stalled(seq, group)


class _Liveness:
    """Each rank's heartbeat count as last read, and when it last changed (monotonic seconds)."""

    def __init__(self):
        self.count: dict[int, int] = {}
        self.changed: dict[int, float] = {}
        self.since: float | None = None  # when this rank started watching (a gap starts anew)
        self.last: float | None = None  # when it last looked

    def observe(self, store, ranks, step: float) -> None:
        now = time.monotonic()
        if self.last is None or now - self.last > 3 * step:
            self.since = now
        self.last = now
        for r in ranks:
            n = int(store.add(f"zfunc/beat/{r}", 0))
            if self.count.get(r) != n:
                self.count[r], self.changed[r] = n, now

    def quiet_for(self, r: int) -> float:
        """Seconds ``r``'s heartbeat has not moved while this rank watched."""
        if self.since is None:
            return 0.0
        return time.monotonic() - max(self.changed.get(r, self.since), self.since)


_liveness = _Liveness()


def _store():
    return dist.distributed_c10d._get_default_store()


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def beat(group=None, watch: bool = False, step: float = 1.0) -> None:
    """Tell the other ranks this one is alive and waiting; with ``watch``, note theirs (looking
    every ``step`` seconds)."""
    if not is_initialized():
        return
    store = _store()
    store.add(f"zfunc/beat/{dist.get_rank()}", 1)
    if watch:
        _liveness.observe(store, _ranks(group), step)


def grace_s(timeout_s: float, group=None) -> float:
    """How long a rank may neither report nor beat before it counts as stuck or dead: three
    slices where waits beat (gloo); elsewhere a waiting rank is silent until its own timeout."""
    step = _slice_s(timeout_s)
    if is_initialized() and dist.get_backend(group) != "gloo":
        return max(3 * step, min(timeout_s, 30.0))
    return 3 * step


def post(tag: str, value: str, group=None) -> None:
    """Set this rank's ``value`` for ``tag`` in the store (``peek`` and ``exchange`` read it)."""
    if is_initialized():
        _store().set(f"zfunc/{tag}/{dist.get_rank()}", value)


def forget(tags) -> None:
    """Remove this rank's posts for ``tags`` (once every rank has read them)."""
    if is_initialized():
        store = _store()
        for tag in tags:
            store.delete_key(f"zfunc/{tag}/{dist.get_rank()}")


def peek(tag: str, group=None) -> list[str | None]:
    """Each rank's value for ``tag`` posted so far (None where none yet), without waiting."""
    if not is_initialized():
        return []
    store = _store()
    return [store.get(f"zfunc/{tag}/{r}").decode() if store.check([f"zfunc/{tag}/{r}"]) else None
            for r in _ranks(group)]


def exchange(tag: str, value: str, group=None, timeout_s: float = 60.0, grace_s: float | None = None,
             give_up=None) -> list[str | None]:
    """Every rank's ``value`` for ``tag``, through the default group's store, not a collective:
    it works when collectives are stuck. A rank that does not post in time gives None; with
    ``grace_s``, so does one that neither posts nor beats its heartbeat for that long (it is
    stuck or dead), while one that beats (it waits in a collective) is waited for; once
    ``give_up()`` is true, so do all that have not posted."""
    if not is_initialized():
        return [value]
    store = _store()
    ranks = _ranks(group)
    me = dist.get_rank()
    store.set(f"zfunc/{tag}/{me}", value)
    out: dict[int, str | None] = {me: value}
    end = time.monotonic() + timeout_s
    step = 0.5 if grace_s is None else grace_s / 3
    pause, beaten = 0.001, 0.0  # look often at first: ranks that agree post together
    while True:
        for r in ranks:
            if r not in out and store.check([f"zfunc/{tag}/{r}"]):
                out[r] = store.get(f"zfunc/{tag}/{r}").decode()
        waiting = [r for r in ranks if r not in out]
        if not waiting:
            break
        if time.monotonic() >= end or (give_up is not None and give_up()):
            out.update({r: None for r in waiting})
            break
        if time.monotonic() - beaten >= step:
            beat(group, watch=grace_s is not None, step=step)
            beaten = time.monotonic()
            if grace_s is not None:
                out.update({r: None for r in waiting if _liveness.quiet_for(r) >= grace_s})
        time.sleep(pause)
        pause = min(2 * pause, step)
    return [out[r] for r in ranks]


def init(backend: str | None = None) -> None:
    """Start the default process group from torchrun's environment, if any.

    A no-op when already initialized or when not launched by torchrun.
    """
    if is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def shutdown() -> None:
    """Barrier, then destroy the default group (gloo may abort at exit otherwise)."""
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` is here (an all-reduce, so the step's timeout applies)."""
    if world_size(group) > 1:
        all_reduce_sum(torch.zeros(1, device=device_of(group)), group, kind="barrier")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


_settle_registered = []


def _settle_before_exit() -> None:
    """Free what zfunc holds, then let gloo's worker threads finish, before the interpreter's teardown.

    A gloo worker drops its reference to a finished collective just after the caller's wait returns;
    when that reference is the tensors' last but their Python object's, the drop takes the GIL. Once
    the interpreter is finalizing, a thread taking the GIL exits through a noexcept destructor and
    the process aborts ("terminate called without an active exception", seen in core dumps as
    ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; PyTorch's own
    issue, not fixed there). The collection frees the engines' reference cycles (their state and
    groups) while the interpreter is whole; the pause hands the GIL to a worker waiting for it."""
    gc.collect()
    if is_initialized():
        time.sleep(0.05)


def check_launch() -> None:
    """Raise if the environment says W > 1 (torchrun) but no process group exists.

    Without this every rank would train alone on its own batches, silently. A started group gets
    ``_settle_before_exit`` at exit (atexit runs it before torch's own handlers, registered earlier).
    """
    if is_initialized() and not _settle_registered:
        _settle_registered.append(atexit.register(_settle_before_exit))
    env = os.environ.get("WORLD_SIZE", "1")
    if not is_initialized() and env.isdigit() and int(env) > 1:
        raise RuntimeError(
            f"WORLD_SIZE={env} in the environment (launched by torchrun?) but no process group "
            "exists, so each rank would train alone: call zf.dist.init() (or "
            "torch.distributed.init_process_group) before step.init and the first step"
        )


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


_groups: dict = {}


def group_key(group) -> tuple[int, ...] | None:
    """Plain data naming ``group``: ``None`` for the default group, else its global ranks.

    Static specs hold this key rather than the ProcessGroup object, so they
    can be pickled, compared and written into checkpoints.
    """
    if group is None or not is_initialized() or group is dist.group.WORLD:
        return None
    key = tuple(dist.get_process_group_ranks(group))
    _groups[key] = group
    return key


def group_of(key: tuple[int, ...] | None):
    """The ProcessGroup that ``group_key`` named in this process."""
    if key is None:
        return None
    try:
        return _groups[key]
    except KeyError:
        raise ValueError(f"no process group over ranks {key} was given to a zfunc transform in this process") from None


def device_of(group=None) -> torch.device:
    """Where this group's collectives want their tensors: CUDA for nccl, else CPU."""
    if is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_compute: dict = {}


def set_compute_device(group, device: torch.device) -> None:
    """Record where the states of steps over ``group`` compute (``Step.init``'s device): under
    gloo that may be a GPU, which ``device_of`` (the collectives' choice) cannot tell."""
    _compute[group_key(group)] = torch.device(device)


def compute_device(group=None) -> torch.device:
    """Where a unit copied in from host memory or read from disk is computed on: the device
    ``Step.init`` put this group's states on, else ``device_of(group)``."""
    return _compute.get(group_key(group)) or device_of(group)


class Pending:
    """A collective in flight: ``wait()`` returns its result (mean-scaled if asked).

    ``out`` exists from the start and is filled by the time ``wait()``
    returns; ``finish`` (if given) runs after the collective to fill it,
    in place of the division by ``divisor``.
    """

    __slots__ = ("out", "work", "divisor", "keep", "finish", "seq")

    def __init__(self, out: torch.Tensor, work=None, divisor: int = 1, keep=None, finish=None, seq=None):
        self.out, self.work, self.divisor, self.keep, self.finish = out, work, divisor, keep, finish
        self.seq = seq  # its place in the step's collectives (the gate's count), if gated

    @property
    def done(self) -> bool:
        """Nothing left to wait for: ``out`` holds the result now."""
        return self.work is None and self.finish is None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            _wait(self.work, self.seq)
            self.work = None
            if self.finish is None and self.divisor != 1:
                self.out.div_(self.divisor)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        self.keep = None
        return self.out

    def cast(self, dtype: torch.dtype | None) -> "Pending":
        """This one with its result in ``dtype`` (``None``: as it is), copied once it is ready."""
        if dtype is None or dtype == self.out.dtype:
            return self
        out = torch.empty(self.out.shape, dtype=dtype, device=self.out.device)
        return self.then(out.copy_, out)

    def then(self, fn, out: torch.Tensor | None = None) -> "Pending":
        """Waits for this one, then calls ``fn(result)``, which fills ``out`` (default: this one's)."""
        return Pending(self.out if out is None else out, finish=lambda: fn(self.wait()))


def all_gather_start(shard: torch.Tensor, group=None, out: torch.Tensor | None = None) -> Pending:
    """Start concatenating every rank's equally sized 1-D ``shard`` into one new tensor (or ``out``)."""
    w = world_size(group)
    if w == 1:
        return Pending(shard)
    shard = shard.contiguous()
    seq = _admit("all_gather", shard, group)
    out = buffers.take(shard.numel() * w, shard.dtype, shard.device) if out is None else out
    _count("all_gather", group, _nbytes(shard, shard.numel() * w))
    return Pending(out, _all_gather_single(out, shard, group=group, async_op=True), keep=shard, seq=seq)


def all_gather_inplace_start(full: torch.Tensor, group=None) -> Pending:
    """Start filling ``full`` (1-D) from every rank's slice of it, where this rank's slice is already in place."""
    w = world_size(group)
    if w == 1:
        return Pending(full)
    seq = _admit("all_gather", full, group)
    _count("all_gather", group, _nbytes(full))
    return Pending(full, _all_gather_single(full, layout.shard(full, rank(group), w), group=group, async_op=True),
                   seq=seq)


def all_gather(shard: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's equally sized 1-D ``shard`` into one new tensor."""
    return all_gather_start(shard, group).wait()


def reduce_scatter_mean_start(full: torch.Tensor, group=None, *, scratch: bool = False,
                              out_dtype: torch.dtype | None = None) -> Pending:
    """Start the mean over ranks of ``full`` (1-D, length divisible by W), this rank's slice.

    With ``scratch`` the caller gives up ``full``: under gloo it is then
    all-reduced in place and sliced, which moves twice the bytes of a
    reduce-scatter yet takes about half the time (gloo's reduce-scatter
    copies its input first and has a slower algorithm); the division by W
    writes the result in ``out_dtype`` (default ``full``'s) in the same pass.
    """
    w = world_size(group)
    if w == 1:
        return Pending(full)
    full = full.contiguous()
    seq = _admit("reduce_scatter", full, group)
    shard_numel = layout.shard_numel(full.numel(), w)
    if scratch and dist.get_backend(group) == "gloo":
        _count("all_reduce", group, _nbytes(full))  # counted as what goes on the wire
        out = buffers.empty(shard_numel, out_dtype or full.dtype, full.device)
        r = rank(group)

        def finish():
            mine = layout.shard(full, r, w)
            if out.dtype == mine.dtype:
                torch.div(mine, w, out=out)
            else:  # in place first: torch.div into another dtype would allocate (and fault in) a temporary
                out.copy_(mine.div_(w))
            del mine
            buffers.give(full)  # the caller gave it up (and no view of it is left): the next of its size reuses it

        return Pending(out, dist.all_reduce(full, group=group, async_op=True), keep=full, finish=finish, seq=seq)
    out = buffers.empty(shard_numel, full.dtype, full.device)
    _count("reduce_scatter", group, _nbytes(full))
    return Pending(out, _reduce_scatter_single(out, full, group=group, async_op=True), w, keep=full,
                   seq=seq).cast(out_dtype)


def all_reduce_mean_start(t: torch.Tensor, group=None) -> Pending:
    """Start the mean over ranks of ``t``, in place."""
    w = world_size(group)
    if w == 1:
        return Pending(t)
    seq = _admit("all_reduce", t, group)
    _count("all_reduce", group, _nbytes(t))
    return Pending(t, dist.all_reduce(t, group=group, async_op=True), w, seq=seq)


def all_reduce_sum(t: torch.Tensor, group=None, *, kind: str = "all_reduce") -> torch.Tensor:
    """Sum over ranks, in place; returns ``t``. ``kind``: what it is counted as (``KINDS``)."""
    if world_size(group) > 1:
        seq = _admit("all_reduce", t, group)
        _count(kind, group, _nbytes(t))
        _wait(dist.all_reduce(t, group=group, async_op=True), seq)
    return t


def all_reduce_mean(t: torch.Tensor, group=None) -> torch.Tensor:
    """Mean over ranks of ``t``, in place; returns ``t``."""
    return all_reduce_mean_start(t, group).wait()


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy group rank ``src``'s ``t`` to every rank, in place; returns ``t``."""
    if world_size(group) > 1:
        seq = _admit("broadcast", t, group)
        _count("broadcast", group, _nbytes(t))
        _wait(dist.broadcast(t, group_src=src, group=group, async_op=True), seq)
    return t


def new_group(ranks: list[int]):
    """A process group over ``ranks`` (every rank of the world calls it, in the same order)."""
    if not is_initialized():
        return None
    group = dist.new_group(sorted(ranks))
    group_key(group)
    return group


def send_start(t: torch.Tensor, dst: int, tag: int = 0) -> Pending:
    """Start sending ``t`` to global rank ``dst`` (point to point); keep ``t`` until ``wait()``."""
    _count("send", None, _nbytes(t))
    return Pending(t, dist.isend(t.contiguous(), dst, tag=tag), keep=t)


def recv(t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Fill ``t`` from global rank ``src`` (point to point); returns ``t``."""
    return recv_start(t, src, tag).wait()


def recv_start(t: torch.Tensor, src: int, tag: int = 0) -> Pending:
    """Start filling ``t`` from global rank ``src``; ``wait()`` returns it. Receives from one
    source with one tag are matched to its sends in order."""
    _count("recv", None, _nbytes(t))
    return Pending(t, dist.irecv(t, src, tag=tag))


def mesh(shard: int | None = None):
    """Hybrid sharding's usual 2-D ``DeviceMesh`` (zero's ``mesh=``): dims ``("replicate", "shard")``,
    each shard group ``shard`` consecutive ranks (default ``LOCAL_WORLD_SIZE``, a node's ranks under
    torchrun, which numbers a node's ranks together), the groups replicas of each other (the nodes).
    Every rank calls it, once per mesh it needs."""
    from torch.distributed.device_mesh import init_device_mesh

    w = world_size()
    if shard is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not local.isdigit():
            raise ValueError("zf.dist.mesh(): LOCAL_WORLD_SIZE is not set (torchrun sets it to a node's ranks); "
                             "give the shard group's size: zf.dist.mesh(shard=k)")
        shard = int(local)
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 1 or w % shard:
        raise ValueError(f"zf.dist.mesh(shard={shard!r}): the shard size must be a positive int that divides the "
                         f"world size, {w}")
    kind = "cuda" if is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(kind, (w // shard, shard), mesh_dim_names=("replicate", "shard"))
