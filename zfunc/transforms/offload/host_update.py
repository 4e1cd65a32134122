"""The host's share of an offloaded update, run unit by unit behind the next step's forward.

Exactness forces only this much to be serial: every gradient reduced, and the ranks agreed on
the global norm and on inf/NaN (clipping, the loss scale, and zfunc's refusal to update on a
non-finite gradient all need it). After that nothing can change a unit's update, so
``offload_cpu`` hands the optimizer a ``schedule`` (zfunc.optim.base: each leaf's
arithmetic deferred, its bookkeeping done at once) and ``UnitUpdates.start`` runs each unit's
share on one worker thread, in the order the next forward uses the units, each unit's upload to
the device right after its update. The step returns at once. Each unit's parameters and
optimizer state carry a ``UnitDone`` (``Params``' filling, the mechanism stages 1 and 2 use for
their all-gathers): the next forward waits for a unit only when it first uses it
(``Params.leaf_when_ready``), and anything else that reads the state (its leaves, a checkpoint,
the next update) waits for every unit first. The arithmetic is the synchronous update's, leaf for
leaf, so the result is bit for bit the same.

An update that raises in any unit is final: the first error goes into the update's ``Fault``
(zfunc.tree), which every ``Params`` the update wrote holds, so every later read of the state raises
it, not only the first; the units after it are not run (nothing can use them).

On CUDA an upload runs on a side stream that first waits for everything the update's caller had
queued (the previous uses of the device buffer), and the forward's stream waits for the upload's
event, not the host. The CPU Adam releases the GIL, so the main thread keeps queuing compute
while the worker updates.
"""
from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ...tree import Fault, UpdateFailed
from .cores import pin_worker


class Uploads:
    """Copies of updated host values into the device's buffers, from the worker thread.

    ``begin()`` (caller's thread) marks what the caller has queued so far; ``copy(dst, src)``
    (worker) queues a copy after that mark and returns its own mark; ``wait(mark)`` (the reader's
    thread) orders what the reader queues next after that copy. Tests stand in a subclass whose
    copies land late, only when waited for."""

    def __init__(self, pin: bool):
        self.cuda = pin and torch.cuda.is_available()
        self._stream = None
        self._begun = None

    def begin(self) -> None:
        if self.cuda:
            self._begun = torch.cuda.Event()
            self._begun.record()

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        if not self.cuda:
            dst.copy_(src)
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(dst.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._begun)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def wait(self, mark) -> None:
        if mark is not None:
            torch.cuda.current_stream().wait_event(mark)


class UnitDone:
    """One unit's host update (and upload) in flight: ``wait()`` returns once the reader may use
    its values; if the update failed (in this unit or one before it) it raises the update's first
    error (``UpdateFailed``), every time. Waiting twice is waiting once."""

    __slots__ = ("future", "uploads", "clock", "fault")

    def __init__(self, future: Future, uploads: Uploads, clock: "UnitUpdates", fault: Fault):
        self.future, self.uploads, self.clock, self.fault = future, uploads, clock, fault

    def wait(self) -> None:
        if not self.future.done():
            began = time.perf_counter()
            concurrent.futures.wait([self.future])
            self.clock.waited_s += time.perf_counter() - began
        if self.future.exception() is not None or self.fault.failed:
            raise self.fault.error()
        self.uploads.wait(self.future.result())


class UnitUpdates:
    """The worker that runs offloaded updates a unit at a time (one per ``offload_cpu``), pinned to
    ``cores`` (zfunc.transforms.offload.cores; None: unpinned, its kernels as many threads as the
    caller's)."""

    def __init__(self, cores: list[int] | None = None):
        self.cores = cores
        self._pool: ThreadPoolExecutor | None = None
        self._last: list[Future] = []
        self.waited_s = 0.0  # time readers spent waiting for units, since the last ``take_waited``

    def drain(self) -> None:
        """Wait for the previous update's every unit: the next update reads and writes the same
        state. It raises nothing: if that update failed, its state refuses to be read (its ``Fault``),
        and the next update may be of another state (one loaded from a checkpoint)."""
        last, self._last = self._last, []
        concurrent.futures.wait(last)

    def start(self, order: list[int], works: dict[int, list[Callable[[], None]]],
              upload: Callable[[int], object], uploads: Uploads, names: list[str] | None = None
              ) -> dict[int, UnitDone]:
        """Run ``works[i]`` then ``upload(i)`` (its mark, or None) for each unit ``i`` in
        ``order`` on the worker; one ``UnitDone`` a unit, all sharing the update's ``Fault``
        (``names``: the units' names, for its error)."""
        self.drain()
        fault = Fault()
        pool = self._worker()
        # the worker's kernels use a thread a core it is pinned to, else as many threads as the caller's
        threads = len(self.cores) if self.cores else torch.get_num_threads()
        uploads.begin()

        def run(i):
            if fault.failed:  # a unit before it failed: the state is refused whole
                raise UpdateFailed("not run: an earlier unit's update failed")
            try:
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                for work in works[i]:
                    work()
                return upload(i)
            except BaseException as e:
                name = repr(names[i] or "<root>") if names is not None else str(i)
                fault.record(e, f"the optimizer update of unit {name} (on offload_cpu's worker thread)")
                raise

        done = {}
        for i in order:
            future = pool.submit(run, i)
            self._last.append(future)
            done[i] = UnitDone(future, uploads, self, fault)
        return done

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zfunc-host-update", initializer=pin_worker,
                                            initargs=(self.cores,))
        return self._pool

    def on_worker(self, fn: Callable[[], object]) -> object:
        """``fn()`` run on the worker thread, after the updates queued before it (what it sees there:
        its cores, its threads)."""
        return self._worker().submit(fn).result()

    def take_waited(self) -> float:
        waited, self.waited_s = self.waited_s, 0.0
        return waited
