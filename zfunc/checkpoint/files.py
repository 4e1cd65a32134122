"""Checkpoint files that say when they are damaged, and writes that survive a kill.

Each tensor in a rank file carries a CRC-32 per ``CHUNK`` bytes, computed while it
is written and kept in the rank's index; a read verifies exactly the chunks it
touches (a load reads only the slices it needs, so a whole-file checksum would
force whole-file reads), once per chunk. The checksum is ``zlib.crc32``: no
CRC32C implementation is available without a new dependency, and zlib's runs at
memory speed on current CPUs. The JSON files (the manifest, the rank indexes)
carry a CRC-32 of their own text: ``{"crc32": "xxxxxxxx", "content": ...}``, still
JSON. A truncated, damaged or missing file raises ``DamagedCheckpointError``
naming the file, the rank and what to do.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import zlib

import torch

from ..ops import aio

CHUNK = 1 << 20  # bytes per checksum: small enough that a resharded load reads little more than it needs
SLACK = 1.05  # free space wanted, relative to the bytes a save writes
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool)}
_JSON_HEAD = re.compile(rb'\{"crc32": "([0-9a-f]{8})", "content": ')
_WHAT_TO_DO = ("load an earlier checkpoint (tag=...) or restore the folder from a copy; nothing was loaded "
               "into the state")


class DamagedCheckpointError(OSError):
    """A checkpoint file is missing, truncated, or its bytes do not match their checksum."""


def damaged(path: str, rank: int | None, what: str) -> DamagedCheckpointError:
    owner = "" if rank is None else f" (rank {rank})"
    return DamagedCheckpointError(f"checkpoint file {path!r}{owner} {what}: {_WHAT_TO_DO}")


# ---------------------------------------------------------------- durable writes


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_space_error(folder: str, need: int, what: str) -> OSError | None:
    """The error to raise before writing ``need`` bytes of ``what`` into ``folder``, if it lacks room."""
    free = shutil.disk_usage(folder).free
    if need * SLACK <= free:
        return None
    return OSError(28, f"not enough free space for {what} in {folder!r}: this rank writes {need} bytes and {free} "
                       "are free; nothing was written, what the folder held is intact")


def write_text(path: str, text: str | bytes) -> None:
    """Write ``path`` atomically and durably: a temporary file, fsync, rename, fsync the folder."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj) -> None:
    text = json.dumps(obj)
    write_text(path, '{"crc32": "%08x", "content": %s}' % (zlib.crc32(text.encode()), text))


def read_json(path: str, rank: int | None = None):
    """The content of a file ``write_json`` wrote, its checksum verified."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise damaged(path, rank, "is missing") from None
    head = _JSON_HEAD.match(raw)
    if head is None or not raw.endswith(b"}"):
        raise damaged(path, rank, "is truncated or damaged (its checksum header or its end is not there)")
    text = raw[head.end(): -1]
    if zlib.crc32(text) != int(head.group(1), 16):
        raise damaged(path, rank, "is damaged (its text does not match its checksum)")
    return json.loads(text)


# ------------------------------------------------------------ tensor files: write


def checksums(data: torch.Tensor) -> list[int]:
    """CRC-32 of each ``CHUNK`` bytes of the 1-d uint8 CPU tensor ``data``."""
    with memoryview(data.numpy()) as view:
        return [zlib.crc32(view[i: i + CHUNK]) for i in range(0, len(view), CHUNK)]


def _write_chunk(io, data: torch.Tensor, path: str, offset: int) -> None:
    io.pwrite(data, path, offset)


class Writer:
    """Appends tensors' raw bytes to one file through zfunc's asynchronous file I/O (direct
    writes where the file system allows, several in flight), checksums and indexes them."""

    def __init__(self, path: str):
        self.path = path
        open(path, "wb").close()
        # checked once, up front; a native back end only if one is built already (no build for a save)
        self.io = aio.AsyncIO(block_size=1 << 22, queue_depth=8, check_space=False, backend=aio.loaded_backend())
        self.index: list[dict] = []
        self.offset = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if data.numel():
            _write_chunk(self.io, data, self.path, self.offset)
        self.index.append({"key": key, "dtype": str(t.dtype), "shape": list(t.shape), "offset": self.offset,
                           "crc32": checksums(data)})  # computed while the write is in flight
        self.offset += data.numel()

    def close(self, extra: dict) -> None:
        self.io.close()  # every write done (or its error raised)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        write_json(self.path[: -len(".bin")] + ".json", {"tensors": self.index, "chunk": CHUNK, **extra})


# ------------------------------------------------------------- tensor files: read


class RankFile:
    """Rank ``rank``'s file of the checkpoint in ``folder``: its index (verified), its bytes
    memory-mapped, each chunk verified the first time a read touches it."""

    def __init__(self, folder: str, rank: int):
        self.rank = rank
        self.path = os.path.join(folder, f"rank{rank}.bin")
        self.meta = read_json(os.path.join(folder, f"rank{rank}.json"), rank)
        self.chunk = self.meta["chunk"]
        self.index = {e["key"]: e for e in self.meta["tensors"]}
        expected = max((e["offset"] + _nbytes(e) for e in self.meta["tensors"]), default=0)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise damaged(self.path, rank, "is missing") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != expected:
                raise damaged(self.path, rank, f"holds {size} bytes but its index says {expected} (truncated?)")
            # copy-on-write: writable for torch.frombuffer, never written back to the file
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self.verified: set[tuple[str, int]] = set()

    def release(self) -> None:
        """Drop the pages of the file read so far from this process's memory (they are read again
        from the file if touched): a reader going through the file once stays at one unit's size."""
        if self.mm is not None:
            self.mm.madvise(mmap.MADV_DONTNEED)

    def entry(self, key: str) -> dict:
        e = self.index.get(key)
        if e is None:
            raise damaged(self.path, self.rank, f"has no tensor {key!r} in its index")
        return e

    def verify(self, key: str, start: int = 0, stop: int | None = None) -> None:
        """Check the chunks holding elements ``[start, stop)`` of tensor ``key`` against their checksums."""
        e = self.entry(key)
        size = _DTYPES[e["dtype"]].itemsize
        nbytes = _nbytes(e)
        stop = nbytes // size if stop is None else stop
        if stop <= start:
            return
        first, last = start * size // self.chunk, (stop * size - 1) // self.chunk
        with memoryview(self.mm) as view:
            for c in range(first, last + 1):
                if (key, c) in self.verified:
                    continue
                lo = e["offset"] + c * self.chunk
                hi = e["offset"] + min((c + 1) * self.chunk, nbytes)
                if zlib.crc32(view[lo:hi]) != e["crc32"][c]:
                    raise damaged(self.path, self.rank, f"is damaged: bytes {lo}-{hi} ({key!r}) do not match "
                                                        "their checksum")
                self.verified.add((key, c))

    def view(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key`` (all of a 0-d one), verified, as a view of the
        mapped file (copy what you keep)."""
        e = self.entry(key)
        dtype = _DTYPES[e["dtype"]]
        n = math.prod(e["shape"])
        if not e["shape"]:
            start, stop = 0, 1
        stop = n if stop is None else stop
        if stop <= start:
            return torch.empty(0 if e["shape"] else (), dtype=dtype)
        self.verify(key, start, stop)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=(stop - start) * dtype.itemsize,
                               offset=e["offset"] + start * dtype.itemsize)
        out = raw.view(dtype)
        return out.reshape(()) if not e["shape"] else out


def _nbytes(e: dict) -> int:
    return math.prod(e["shape"]) * _DTYPES[e["dtype"]].itemsize


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]
