"""The one shared helper for multi-process tests: W gloo processes on localhost
(or W nccl processes, one GPU each, where CUDA exists: ``workers(world, "nccl")``).

Processes are started once per world size and kept for the session, so a test
(or a hypothesis example) costs only its own work. ``group.run(fn, *args)``
calls the top-level function ``fn(*args)`` on every rank and returns the
results in rank order; an exception on any rank is raised here with its
traceback, and a rank that does not answer in time fails the test rather
than hanging it. After a failure the processes are restarted.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback

TIMEOUT_S = 180


def _serve(rank: int, world: int, store_path: str, inbox, outbox, env: dict, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(env)  # before torch reads it (e.g. TORCH_FR_BUFFER_SIZE, read when the group is made)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(*args)))
        except BaseException:  # report everything, including assertion errors
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerGroup:
    def __init__(self, world: int, env: dict | None = None, backend: str = "gloo"):
        self.world = world
        self.env = dict(env or {})
        self.backend = backend
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="zfunc-gloo-")
        store = os.path.join(self._dir, "store")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.world, store, self.inboxes[r], self.outbox, self.env, self.backend), daemon=True)
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        for box in self.inboxes:
            box.put((fn, args))
        results: dict[int, object] = {}
        errors = []
        try:
            while len(results) + len(errors) < self.world:
                rank, ok, value = self.outbox.get(timeout=TIMEOUT_S)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    if len(errors) == 1:
                        break  # the other ranks may be stuck in a collective
        except queue.Empty:
            errors.append(f"ranks {sorted(set(range(self.world)) - set(results))} did not answer in {TIMEOUT_S}s")
        if errors:
            self.restart()
            raise AssertionError("worker failed\n" + "\n".join(errors))
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def restart(self) -> None:
        for p in self.procs:
            p.kill()
            p.join()
        self._start()


_groups: dict[tuple[int, str], WorkerGroup] = {}


def workers(world: int, backend: str = "gloo") -> WorkerGroup:
    """The session's worker group of ``world`` ranks, started on first use."""
    if (world, backend) not in _groups:
        _groups[world, backend] = WorkerGroup(world, backend=backend)
    return _groups[world, backend]


class fresh_workers:
    """``with fresh_workers(world) as group:`` new processes, closed after (for peak-memory checks);
    ``env``: environment variables the processes set before torch starts."""

    def __init__(self, world: int, env: dict | None = None):
        self.group = WorkerGroup(world, env)

    def __enter__(self) -> WorkerGroup:
        return self.group

    def __exit__(self, *exc) -> None:
        self.group.close()


def close_all() -> None:
    for g in _groups.values():
        g.close()
    _groups.clear()
