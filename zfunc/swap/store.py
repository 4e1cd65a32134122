"""A state's swap store: its folder, its files, their reads and writes, and its failures.

A ``SwapStore`` owns one state's folder, ``path/rank{r}/state-XXXXXX/``, made
fresh for every ``Step.init`` so two states never share a file (zfunc.swap.folders). Each on-disk
tensor is one file per (unit, kind), named for what it holds, e.g.
``u002-blocks.1.exp_avg.fp32.4096_8192.swp`` (unit 2, module ``blocks.1``, Adam's
first moment in fp32, this rank's elements 4096 to 4096 + 8192 of the unit's
flat buffer), allocated to its full size when it is made, after one free-space
check for everything the state will write (so a step never grows a file). In the state it is a
placeholder (zfunc.swap.placeholders).

All I/O goes through ``zfunc.ops.aio``. Units read in for compute land in a
fixed pool of ``buffer_count`` aligned buffers (zfunc.swap.pool); a unit larger
than a pool buffer gets a buffer of its own for as long as compute uses it (on
the CPU, where that buffer is the unit compute sees), or passes through the pool
buffers a buffer's worth at a time on its way to an accelerator. The optimizer's
streaming update has its own staging arenas (zfunc.transforms.offload.nvme_update), the last of
which stays ``resident`` between steps: reads of its files are served from it.

A failed write during an update leaves some units updated and others not: the
store then refuses every later use, saying so, rather than train on a mix. A
failure before the update (reading parameters, writing gradients) changes
nothing the state keeps, so the same state can step again once the cause is
fixed. ``close()`` removes the folder, and the folders above it that a store made
where they are empty; so does interpreter exit, and so does a ``Step.init`` that raises.

Where compute runs on an accelerator (zfunc.swap.device), a unit read into a pool buffer
is copied to the device without blocking, and a gradient comes back through two
pinned staging buffers of a pool buffer's size, a part at a time: the host waits
for each copy (an event) before it reads, writes out or reuses the host buffer.
So host memory stays the pool, the staging buffers and the update's arenas,
whatever the size of a unit.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import os
import shutil
from dataclasses import dataclass

import torch

from .. import buffers, dist
from ..ops import aio
from .device import Device
from .faults import Faults
from .folders import fresh_folder, remove_made
from .placeholders import SwapFile, by_id, forget, locate, open_stores, record
from .pool import BufferPool, aligned, parts


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous in host memory, to be written to a file (``.cpu()`` waits for its copy)."""
    return t.contiguous() if t.device.type == "cpu" else t.cpu()


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class Resident:
    """The staging set the last update left in place: its slot, pieces of units, buffers by
    (role, key, piece) and by file, and the handle whose writes of it may still be in flight."""

    slot: int
    pieces: frozenset
    bufs: dict
    handle: object
    files: dict  # path -> ((role, key, piece), byte offset of the buffer's values in the file, bytes)

    def buffer(self, path: str, offset: int, nbytes: int):
        """The buffer holding bytes ``offset`` to ``offset + nbytes`` of ``path``, if one holds exactly those."""
        entry = self.files.get(path)
        return None if entry is None or entry[1:] != (offset, nbytes) else self.bufs.get(entry[0])


class SwapStore:
    """One state's swap folder, its files, its I/O handles and its buffer pool."""

    def __init__(self, root: str, *, aio_config: dict | None, buffer_count: int, buffer_bytes: int,
                 faults: Faults | None = None, device: Device | None = None):
        self.dev = device if device is not None else Device("cpu")
        self.staging = [torch.empty(0, dtype=torch.uint8)] * 2  # pinned: gradients on their way to disk
        self._turn = 0
        self.busy: list = []  # events of uploads out of the update's staging sets (quiesce)
        self.faults = faults if faults is not None else Faults()
        self.aio_config = dict(aio_config or {})
        aio.AsyncIO.from_config(self.aio_config).close()  # bad keys fail here, before any file
        self.pool = BufferPool(buffer_count, buffer_bytes)
        self._idle: list[aio.AsyncIO] = []
        self.writer = self._handle()  # gradient writes during backward
        rank_dir = os.path.join(os.path.abspath(os.fspath(root)), f"rank{dist.rank()}")
        self.rank_dir = rank_dir
        try:
            self.dir = fresh_folder(rank_dir)
        except OSError as e:
            self.writer.close()
            remove_made(rank_dir)
            raise OSError(e.errno, f"offload_nvme: cannot make the swap folder under '{rank_dir}': "
                                   f"{e.strerror}; pass a path= on a writable disk", rank_dir) from None
        self.key = self.dir
        self.failed: str | None = None
        self.closed = False
        self.grad_stats: dict[int, tuple[float, bool]] = {}  # id(placeholder) -> (sum of squares, finite)
        self.staged: dict[int, tuple[str, torch.dtype]] = {}  # id(param placeholder) -> (file, dtype) of its init values
        self.bytes_read = 0
        self.bytes_written = 0
        self.oversize = 0  # units larger than a pool buffer read in
        self.arenas: list[torch.Tensor] = []  # the update's staging buffers (zfunc.transforms.offload.nvme_update)
        self._mine: list[int] = []
        # set by offload_nvme: gradient placeholders by unit, whether the optimizer state goes to
        # disk, and each unit's element offset of this rank's part (for file names)
        self.grads: dict[int, torch.Tensor] = {}
        # the last update's final sub-group, kept in its staging set (zfunc.transforms.offload.nvme_update): reads of
        # its files are served from RAM, gradients of its units written there, its writes in flight
        self.resident: Resident | None = None
        self.resident_grads: set[str] = set()
        self.offsets: list[int] = []
        open_stores[self.key] = self

    # ------------------------------------------------------------ files

    def reserve(self, nbytes: int) -> None:
        """Raise now, naming needed and free bytes, if the disk cannot hold ``nbytes`` more."""
        try:
            aio.check_free_space(os.path.join(self.dir, "x"), nbytes)
        except OSError as e:
            self.close()
            raise OSError(e.errno, f"offload_nvme: not enough free space for this state's swap files: {e.strerror}",
                          self.dir) from None

    def create(self, unit: int, unit_name: str, kind: str, numel: int, dtype: torch.dtype, offset: int = 0
               ) -> torch.Tensor:
        """A new swap file of ``numel`` elements, allocated on disk; its placeholder."""
        name = f"u{unit:03d}-{unit_name or 'root'}.{kind}.{_short(dtype)}.{offset}_{numel}.swp"
        file = SwapFile(os.path.join(self.dir, name), numel, dtype)
        self._allocate(file.path, file.nbytes)
        placeholder = torch.empty(numel, dtype=dtype, device="meta")
        record(self, file, placeholder)
        self._mine.append(id(placeholder))
        return placeholder

    def _allocate(self, path: str, nbytes: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise OSError(e.errno, f"offload_nvme: cannot allocate {nbytes} bytes for swap file: {e.strerror}",
                          path) from None
        finally:
            os.close(fd)

    def file_of(self, t: torch.Tensor) -> SwapFile:
        return locate(t)[1]

    # --------------------------------------------------------------- I/O

    def _handle(self) -> aio.AsyncIO:
        return self._idle.pop() if self._idle else aio.AsyncIO.from_config(self.aio_config, check_space=False)

    UNCHANGED = ("; nothing this state keeps was changed: fix the cause (free the disk) and call the "
                 "step again with the same state")

    def _io(self, what: str, fn, hint: str = ""):
        try:
            return fn()
        except (OSError, EOFError) as e:
            err = getattr(e, "errno", None) or errno.EIO
            raise OSError(err, f"offload_nvme: {what} failed: {e}{hint}") from e

    @contextlib.contextmanager
    def _borrowed(self):
        """An idle handle for the ``with`` block, given back after."""
        h = self._handle()
        try:
            yield h
        finally:
            self._idle.append(h)

    def read_now(self, out: torch.Tensor, file: SwapFile, offset: int = 0) -> torch.Tensor:
        self.settle()  # a resident write to this file may be in flight
        if out.device.type != "cpu":  # e.g. an accumulator on the GPU: through host memory, a part at a time
            flat, item = out.view(-1), out.element_size()
            host = torch.empty(min(flat.numel(), self._part(item)), dtype=out.dtype)
            for a, b in parts(flat.numel(), host.numel()):
                flat[a:b].copy_(self.read_now(host[: b - a], file, offset + a * item))
            return out
        with self._borrowed() as h:
            self._io(f"reading '{file.path}'", lambda: (h.pread(out, file.path, offset), h.wait()))
        self.bytes_read += out.numel() * out.element_size()
        return out

    def read_start(self, placeholder: torch.Tensor) -> dist.Pending:
        """Start reading a unit's parameters into a pool buffer (one of its own if it is larger);
        ``wait()`` returns the buffer, or where compute runs on a device (``self.dev.copies``) a
        device tensor the buffer is uploaded into (a larger unit: a pool buffer's worth at a time)."""
        _, file, offset = locate(placeholder)
        dev = self.dev
        nbytes = placeholder.numel() * placeholder.element_size()
        self.oversize += nbytes > self.pool.nbytes
        out = buffers.take(placeholder.numel(), placeholder.dtype, dev.device) if dev.copies else None
        held = self.resident_buffer(file.path, offset, nbytes)
        if held is not None:
            if out is not None:  # the update overwrites ``held`` only after this upload (quiesce)
                dev.upload(out, held)
                self.busy.append(dev.event())
                return dist.Pending(out)
            buf = self.pool.take(placeholder.numel(), placeholder.dtype)
            return dist.Pending(buf.copy_(held))  # the resident sub-group's values, already in RAM
        if self.resident is not None and file.path in self.resident.files:
            self.settle()  # a piece of this file is resident: its write may be in flight
        if out is not None and nbytes > self.pool.nbytes:
            return self._read_through_pool(placeholder, file, offset, out)
        buf = self.pool.take(placeholder.numel(), placeholder.dtype)
        h = self._handle()
        self.faults.fire("read", h)
        try:
            self._io(f"reading '{file.path}'", lambda: h.pread(buf, file.path, offset), self.UNCHANGED)
        except BaseException:
            self._idle.append(h)
            self.give(buf)
            raise
        self.bytes_read += buf.numel() * buf.element_size()

        def finish():
            try:
                self._io(f"reading '{file.path}'", h.wait, self.UNCHANGED)
            except BaseException:
                self.give(buf)
                raise
            finally:
                self._idle.append(h)
            if out is not None:  # the buffer goes back now; it is read into again once the upload is done
                dev.upload(out, buf)
                self.pool.give(buf, dev.event())

        return dist.Pending(buf if out is None else out, finish=finish)

    def _read_through_pool(self, placeholder: torch.Tensor, file: SwapFile, offset: int, out: torch.Tensor
                           ) -> dist.Pending:
        """A unit larger than a pool buffer, bound for the device ``out``: read a pool buffer's worth
        at a time, each part uploaded into its slice of ``out`` while the next two are read, so host
        memory stays the pool whatever the unit's size."""
        item = placeholder.element_size()
        todo = iter(parts(placeholder.numel(), self.pool.nbytes // item))
        flight = collections.deque()  # (start, stop, buffer, handle) of the reads in flight

        def start() -> None:
            part = next(todo, None)
            if part is None:
                return
            a, b = part
            buf, h = self.pool.take(b - a, placeholder.dtype), self._handle()
            flight.append((a, b, buf, h))
            self.faults.fire("read", h)
            self._io(f"reading '{file.path}'", lambda: h.pread(buf, file.path, offset + a * item), self.UNCHANGED)
            self.bytes_read += (b - a) * item

        def drain() -> None:  # after a failure: nothing may still read into a buffer given back
            while flight:
                _, _, buf, h = flight.popleft()
                with contextlib.suppress(OSError, EOFError):
                    h.wait()
                self._idle.append(h)
                self.give(buf)

        def finish() -> None:
            try:
                while flight:
                    a, b, buf, h = flight[0]
                    self._io(f"reading '{file.path}'", h.wait, self.UNCHANGED)
                    flight.popleft()
                    self._idle.append(h)
                    self.dev.upload(out[a:b], buf)
                    self.pool.give(buf, self.dev.event())  # read into again once this upload is done
                    start()
            except BaseException:
                drain()
                raise

        try:
            start()
            start()
        except BaseException:
            drain()
            raise
        return dist.Pending(out, finish=finish)

    def _part(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes in one pool buffer: the most a transfer through host memory
        moves at once."""
        return max(1, self.pool.nbytes // itemsize)

    def write(self, handle: aio.AsyncIO, data: torch.Tensor, placeholder: torch.Tensor, offset: int = 0,
              hint: str = "") -> None:
        """Queue writing ``data`` into ``placeholder``'s file at ``offset`` bytes past its own start."""
        _, file, base = locate(placeholder)
        data = _host(data)
        self._io(f"writing '{file.path}'", lambda: handle.pwrite(data, file.path, base + offset), hint)
        self.bytes_written += data.numel() * data.element_size()

    def wait(self, handle: aio.AsyncIO, what: str, hint: str = "") -> None:
        self._io(what, handle.wait, hint)

    # ---------------------------------------------------------- the resident sub-group

    def resident_buffer(self, path: str, offset: int, nbytes: int) -> torch.Tensor | None:
        """The resident buffer holding exactly bytes ``offset`` to ``offset + nbytes`` of ``path``, or None."""
        return None if self.resident is None else self.resident.buffer(path, offset, nbytes)

    def keep_resident(self, slot: int, pieces, bufs: dict, handle, files: dict) -> None:
        self.resident = Resident(slot, frozenset(pieces), bufs, handle, files)

    def settle(self, *, quiet: bool = False) -> None:
        """Wait for the resident sub-group's writes. A failure means the files are partly updated:
        the store refuses to go on (``fail``), and says so here (unless ``quiet``)."""
        res = self.resident
        if res is None or res.handle is None:
            return
        handle, res.handle = res.handle, None
        try:
            self._io("writing the optimizer state", handle.wait)
        except OSError as e:
            self.fail(f"an update's write failed ({e})")
            if not quiet:
                raise
        finally:
            self._idle.append(handle)

    def quiesce(self) -> None:
        """Wait for the uploads out of the resident staging set, before anything writes into it."""
        for event in self.busy:
            event.synchronize()
        self.busy = []

    def drop_resident(self, *, quiet: bool = False) -> None:
        """Give up the resident sub-group (its gradients of this step go to their files first)."""
        res = self.resident
        if res is None:
            return
        self.settle(quiet=quiet)
        self.resident = None
        for path in self.resident_grads:
            key, offset, _ = res.files[path]
            if not self.closed:
                self.write_now(res.bufs[key], self.grads[key[2][0]], offset)  # key[2]: (unit, start, stop)
        self.resident_grads = set()

    def give(self, buf: torch.Tensor) -> bool:
        """Return a buffer ``read_start`` handed out (False if it is not one)."""
        return self.pool.give(buf)

    # --------------------------------------------------------------- init staging

    def put(self, unit: int, unit_name: str, kind: str, values: torch.Tensor, offset: int) -> torch.Tensor:
        """At init: a new swap file holding ``values`` (a unit's frozen shard, already in its stored
        dtype; nothing reads it before the first step, so it needs no staging); its placeholder."""
        placeholder = self.create(unit, unit_name, kind, values.numel(), values.dtype, offset)
        self.write_now(values, placeholder)
        buffers.trim()  # as for stage: the last unit's init temporaries go back to the OS
        return placeholder

    def stage(self, unit: int, unit_name: str, values: torch.Tensor, dtype: torch.dtype, offset: int) -> torch.Tensor:
        """At init: write a unit's parameter shard (model dtype) to a staging file and return the
        placeholder of its swap file in the stored ``dtype``; ``take_staged`` reads it back once."""
        placeholder = self.create(unit, unit_name, "param", values.numel(), dtype, offset)
        path = locate(placeholder)[1].path + ".init"
        values = _host(values)
        self._io(f"writing '{path}'", lambda: aio.write_file_atomic(path, values))
        self.bytes_written += values.numel() * values.element_size()
        self.staged[id(placeholder)] = (path, values.dtype)
        del values
        buffers.trim()  # the unit's init temporaries go back to the OS before the next unit's
        return placeholder

    def is_staged(self, placeholder: torch.Tensor) -> bool:
        return id(placeholder) in self.staged

    def take_staged(self, placeholder: torch.Tensor, piece: int):
        """The init values ``stage`` wrote for this placeholder, ``piece`` elements at a time:
        ``(start, values)`` pairs; the staging file goes after the last."""
        path, dtype = self.staged.pop(id(placeholder))
        file = SwapFile(path, placeholder.numel(), dtype)
        for a, b in parts(file.numel, piece):
            yield a, self.read_now(torch.empty(b - a, dtype=dtype), file, a * dtype.itemsize)
        os.unlink(path)

    def finish_staged(self, piece: int) -> None:
        """Write every still-staged parameter into its swap file, in its stored dtype, ``piece``
        elements at a time."""
        for pid in list(self.staged):
            placeholder = by_id(pid)
            for a, values in self.take_staged(placeholder, piece):
                self.write_now(values.to(placeholder.dtype), placeholder, a * placeholder.element_size())

    def write_now(self, data: torch.Tensor, placeholder: torch.Tensor, offset: int = 0) -> None:
        with self._borrowed() as h:
            self.write(h, data, placeholder, offset)
            self.wait(h, f"writing '{self.file_of(placeholder).path}'")

    def write_gradient(self, data: torch.Tensor, placeholder: torch.Tensor, stats: tuple[float, bool],
                       offset: int = 0) -> None:
        """Queue a unit's gradient (or its sum so far) into its file, one write in flight so memory
        stays bounded (from a device: a pool buffer's worth at a time); ``stats`` (sum of squares,
        finite) are what the step's agreement reads."""
        self.grad_stats[id(placeholder)] = stats
        item = data.element_size()
        step = self._part(item) if self.dev.copies else max(1, data.numel())
        for a, b in parts(data.numel(), step):
            host = self.to_host(data[a:b])
            self.wait(self.writer, "writing gradients", self.UNCHANGED)
            self.faults.fire("grad", self.writer)
            self.write(self.writer, host, placeholder, offset + a * item, self.UNCHANGED)

    def to_host(self, data: torch.Tensor) -> torch.Tensor:
        """A device-side gradient (at most a pool buffer of it) in a pinned staging buffer, landed (as
        it is on the CPU). Two buffers take turns: the write queued from the other may still be in
        flight, none from this one."""
        if not self.dev.copies:
            return data
        nbytes = data.numel() * data.element_size()
        self._turn = k = 1 - self._turn
        if self.staging[k].numel() < nbytes:  # made once, a pool buffer's size (a larger gradient comes in parts)
            self.staging[k] = torch.empty(0, dtype=torch.uint8)  # drop the old one first
            self.staging[k] = aio.aligned_empty(max(aligned(nbytes), self.pool.nbytes))
        return self.dev.fetch(self.staging[k][:nbytes].view(data.dtype), data)

    # --------------------------------------------------------------- lifecycle

    def fail(self, why: str) -> None:
        self.failed = why

    def check_usable(self) -> None:
        if self.closed:
            raise RuntimeError(f"the swap files of this state ({self.dir}) were removed by close(); "
                               "a closed state cannot be used: build a new one with step.init")
        if self.failed:
            raise RuntimeError(
                f"this state's swap files are in an unknown state: {self.failed}. Some units may have been "
                "updated and others not, so this state refuses to train on. Free the disk (or fix the error), "
                "then build the state again (step.init) or load your last checkpoint"
            )

    def resident_bytes(self) -> int:
        """Bytes of the buffers this store keeps between steps: the pool and the update's arenas."""
        return self.pool.resident_bytes() + sum(a.numel() for a in [*self.arenas, *self.staging])

    def close(self) -> None:
        """Remove the swap folder; the state that owned it can no longer be used."""
        if self.closed:
            return
        self.settle(quiet=True)
        self.quiesce()
        self.resident = None
        self.closed = True
        for h in [self.writer, *self._idle]:
            try:
                h.close()
            except OSError:
                pass  # the files go now anyway
        self._idle.clear()
        forget(self._mine)
        self._mine.clear()
        self.arenas.clear()
        self.staging = [torch.empty(0, dtype=torch.uint8)] * 2
        open_stores.pop(self.key, None)
        shutil.rmtree(self.dir, ignore_errors=True)
        remove_made(self.rank_dir)  # the folders above it that a store made, unless another state uses them
