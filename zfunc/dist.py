"""Process groups and the few collectives zfunc uses, all in one place.

W = 1 needs no process group at all. Under torchrun, ``init()`` reads the
environment and picks gloo on CPU, nccl on CUDA. Every collective in the
library goes through this module, so the torch API it depends on lives here.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import os

import torch
import torch.distributed as dist

from . import buffers, layout

_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar("zfunc_collective_timeout", default=None)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the step's timeout (another rank is elsewhere)."""


@contextlib.contextmanager
def deadline(seconds: float | None):
    """Collectives waited for inside raise ``CollectiveTimeout`` after ``seconds`` (None: wait forever)."""
    token = _timeout.set(seconds)
    try:
        yield
    finally:
        _timeout.reset(token)


def _wait(work) -> None:
    seconds = _timeout.get()
    if seconds is None:
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        raise CollectiveTimeout(
            f"a collective did not complete within {seconds:g} s: another rank is not taking part in it "
            "(it diverged, failed or is much slower). The process group cannot be used after this"
        ) from e


def exchange(tag: str, value: str, group=None, timeout_s: float = 60.0) -> list[str | None]:
    """Every rank's ``value`` for ``tag``, through the default group's store, not a collective:
    it works when collectives are stuck. A rank that does not post in time gives None."""
    if not is_initialized():
        return [value]
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    store.set(f"zfunc/{tag}/{dist.get_rank()}", value)
    out = []
    for r in ranks:
        key = f"zfunc/{tag}/{r}"
        try:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            out.append(store.get(key).decode())
        except (RuntimeError, dist.DistError):
            out.append(None)
    return out

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
        all_reduce_sum(torch.zeros(1, device=device_of(group)), group)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def check_launch() -> None:
    """Raise if the environment says W > 1 (torchrun) but no process group exists.

    Without this every rank would train alone on its own batches, silently.
    """
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


class Pending:
    """A collective in flight: ``wait()`` returns its result (mean-scaled if asked).

    ``out`` exists from the start and is filled by the time ``wait()``
    returns; ``finish`` (if given) runs after the collective to fill it,
    in place of the division by ``divisor``.
    """

    __slots__ = ("out", "work", "divisor", "keep", "finish")

    def __init__(self, out: torch.Tensor, work=None, divisor: int = 1, keep=None, finish=None):
        self.out, self.work, self.divisor, self.keep, self.finish = out, work, divisor, keep, finish

    @property
    def done(self) -> bool:
        """Nothing left to wait for: ``out`` holds the result now."""
        return self.work is None and self.finish is None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            _wait(self.work)
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
    out = buffers.take(shard.numel() * w, shard.dtype, shard.device) if out is None else out
    return Pending(out, dist.all_gather_single(out, shard, group=group, async_op=True), keep=shard)


def all_gather_inplace_start(full: torch.Tensor, group=None) -> Pending:
    """Start filling ``full`` (1-D) from every rank's slice of it, where this rank's slice is already in place."""
    w = world_size(group)
    if w == 1:
        return Pending(full)
    return Pending(full, dist.all_gather_single(full, layout.shard(full, rank(group), w), group=group, async_op=True))


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
    shard_numel = layout.shard_numel(full.numel(), w)
    if scratch and dist.get_backend(group) == "gloo":
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

        return Pending(out, dist.all_reduce(full, group=group, async_op=True), keep=full, finish=finish)
    out = buffers.empty(shard_numel, full.dtype, full.device)
    return Pending(out, dist.reduce_scatter_single(out, full, group=group, async_op=True), w, keep=full).cast(out_dtype)


def all_reduce_mean_start(t: torch.Tensor, group=None) -> Pending:
    """Start the mean over ranks of ``t``, in place."""
    w = world_size(group)
    if w == 1:
        return Pending(t)
    return Pending(t, dist.all_reduce(t, group=group, async_op=True), w)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks, in place; returns ``t``."""
    if world_size(group) > 1:
        _wait(dist.all_reduce(t, group=group, async_op=True))
    return t


def all_reduce_mean(t: torch.Tensor, group=None) -> torch.Tensor:
    """Mean over ranks of ``t``, in place; returns ``t``."""
    return all_reduce_mean_start(t, group).wait()


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy group rank ``src``'s ``t`` to every rank, in place; returns ``t``."""
    if world_size(group) > 1:
        _wait(dist.broadcast(t, group_src=src, group=group, async_op=True))
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
    return Pending(t, dist.isend(t.contiguous(), dst, tag=tag), keep=t)


def recv(t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Fill ``t`` from global rank ``src`` (point to point); returns ``t``."""
    return recv_start(t, src, tag).wait()


def recv_start(t: torch.Tensor, src: int, tag: int = 0) -> Pending:
    """Start filling ``t`` from global rank ``src``; ``wait()`` returns it. Receives from one
    source with one tag are matched to its sends in order."""
    return Pending(t, dist.irecv(t, src, tag=tag))
