"""The file one rank's offloaded parts go to under ``zf.offload_states(device="nvme", path=)``.

Written under a ``.part`` name and renamed once complete, so a file under its final name always
holds every byte; removed by the reload that reads it back, or by the offload that fails while
writing it. Not fsynced: the file is of use only to the process that wrote it, which a crash ends
too, so the kernel writes it back in the background (an fsync made an offload of a 380 MB state
take 2 s here instead of a few tenths). Device memory passes through a page-locked staging buffer a chunk at
a time (taken from and given back to ``host_buffers``); host memory is written and read in place.
"""
from __future__ import annotations

import os
import tempfile

import torch

from .host import host_buffers

CHUNK_BYTES = 64 << 20  # the staging buffer between a device and the file


class OffloadFile:
    """A file being written: ``append`` the bytes of each storage, then ``commit`` (or ``discard``)."""

    def __init__(self, folder: str, rank: int):
        fd, self.part = tempfile.mkstemp(prefix=f"zfunc-offload-rank{rank}-", suffix=".bin.part", dir=folder)
        self.path = self.part[: -len(".part")]
        self._file = os.fdopen(fd, "wb")
        self.size = 0

    def append(self, data: torch.Tensor) -> int:
        """Write the bytes of ``data`` (a contiguous ``uint8`` tensor, host or device); its offset."""
        offset = self.size
        if data.device.type == "cpu":
            self._file.write(memoryview(data.numpy()))
        else:
            with _staging(data.numel()) as chunk:
                for lo in range(0, data.numel(), chunk.numel()):
                    piece = chunk[: min(chunk.numel(), data.numel() - lo)]
                    piece.copy_(data[lo: lo + piece.numel()])  # blocking: the file takes it next
                    self._file.write(memoryview(piece.numpy()))
        self.size += data.numel()
        return offset

    def commit(self) -> str:
        """Give the complete file its final name; returns that name."""
        self._file.close()
        os.replace(self.part, self.path)
        return self.path

    def discard(self) -> None:
        """Close and remove whatever was written (a failed offload)."""
        try:
            self._file.close()
        finally:
            for name in (self.part, self.path):
                try:
                    os.remove(name)
                except FileNotFoundError:
                    pass


def read_into(path: str, offset: int, out: torch.Tensor) -> None:
    """Fill ``out`` (a contiguous ``uint8`` tensor, host or device) from ``path`` at ``offset``."""
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        if out.device.type == "cpu":
            _read_exactly(f, out, path)
            return
        with _staging(out.numel()) as chunk:
            for lo in range(0, out.numel(), chunk.numel()):
                piece = chunk[: min(chunk.numel(), out.numel() - lo)]
                _read_exactly(f, piece, path)
                out[lo: lo + piece.numel()].copy_(piece)  # blocking: the chunk is read into next


def _read_exactly(f, out: torch.Tensor, path: str) -> None:
    view = memoryview(out.numpy())
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(f"{path} ends {len(view) - got} bytes early: the file zf.offload_states wrote was cut "
                          "short or replaced, so this state cannot be reloaded from it")
        got += n


class _staging:
    """A page-locked chunk buffer for the copies between a device and a file."""

    def __init__(self, nbytes: int):
        self.buf = host_buffers.take(min(nbytes, CHUNK_BYTES), pin=torch.cuda.is_available())

    def __enter__(self) -> torch.Tensor:
        return self.buf

    def __exit__(self, *exc) -> None:
        host_buffers.give(self.buf)
