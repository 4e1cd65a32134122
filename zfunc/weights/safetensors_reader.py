"""Safetensors checkpoints read in byte ranges: a folder's files, their headers, parts of one tensor.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the tensors' bytes, each row-major and contiguous, at ``8 + N + begin``. So any
run of a tensor's elements in flat order is one byte range of the file, and a rank
reads exactly the elements its shards hold (``read_into``) with plain ``pread``s,
never a whole file. ``save_pretrained`` writes ``model.safetensors``, or
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``) and its shards.

Every check names the file and, where there is one, the tensor: a header that is
not JSON or runs past the end, a tensor whose bytes lie past the end (a truncated
file), a size that does not match its shape and dtype, an index that names a file
or tensor that is not there.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ADAPTER = "adapter_model.safetensors"
MAX_HEADER = 100 << 20  # as the safetensors library: a larger header is damage, not a model

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsError(ValueError):
    """A safetensors file or index is missing, damaged or does not hold what it says."""


class TensorInfo(NamedTuple):
    """Where one tensor lives: its file, dtype, shape, and its first byte in the file."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of element 0 in ``file``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _locate(path) -> tuple[list[str], str | None, dict]:
    """``(files, index file or None, its weight map)`` of ``path``: a folder ``save_pretrained`` wrote
    (``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names), an index
    file, or one ``.safetensors`` file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX)):
            return _index(os.path.join(path, INDEX))
        if os.path.exists(os.path.join(path, SINGLE)):
            return [os.path.join(path, SINGLE)], None, {}
        if os.path.exists(os.path.join(path, ADAPTER)):  # peft's PeftModel.save_pretrained
            return [os.path.join(path, ADAPTER)], None, {}
        raise SafetensorsError(f"folder {path!r} holds neither {SINGLE} nor {INDEX} (nor peft's {ADAPTER}): pass "
                               "the folder save_pretrained wrote, an index file, or one .safetensors file")
    if not os.path.exists(path):
        raise SafetensorsError(f"weights {path!r} do not exist")
    if path.endswith(".json"):
        return _index(path)
    return [path], None, {}


def _index(index: str) -> tuple[list[str], str, dict]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SafetensorsError(f"index {index!r} is not a safetensors index ({type(e).__name__}: {e}); it "
                               'should be JSON with a "weight_map" of tensor name -> file') from None
    folder = os.path.dirname(index)
    paths = [os.path.join(folder, f) for f in files]
    for p in paths:
        if not os.path.exists(p):
            raise SafetensorsError(f"index {index!r} names file {os.path.basename(p)!r}, which is not in {folder!r}")
    return paths, index, weight_map


def read_header(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> ``TensorInfo`` from ``path``'s header, every entry checked against the file's size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(size - 8, MAX_HEADER):
                raise SafetensorsError(f"safetensors file {path!r} is truncated or damaged: its header length "
                                       f"({n if n is not None else 'missing'}) does not fit the file's {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"cannot read safetensors file {path!r}: {e}") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"safetensors file {path!r} has a damaged header (not JSON: {e})") from None
    data_start, data_size = 8 + n, size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, entry, data_start, data_size)
    return out


def _entry(path: str, name: str, entry, data_start: int, data_size: int) -> TensorInfo:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise SafetensorsError(f"safetensors file {path!r} has a damaged header entry for tensor {name!r} "
                               f"({type(e).__name__}: {e})") from None
    if any(s < 0 for s in shape) or not 0 <= begin <= end:
        raise SafetensorsError(f"safetensors file {path!r} has a damaged header entry for tensor {name!r}: "
                               f"shape {shape}, data_offsets [{begin}, {end}]")
    info = TensorInfo(path, name, dtype, shape, data_start + begin)
    if end - begin != info.nbytes:
        raise SafetensorsError(f"safetensors file {path!r}: tensor {name!r} has {end - begin} bytes, but shape "
                               f"{shape} of {entry['dtype']} needs {info.nbytes}")
    if end > data_size:
        raise SafetensorsError(f"safetensors file {path!r} is truncated: tensor {name!r} ends at byte "
                               f"{data_start + end}, past the file's end at {data_start + data_size}")
    return info


def tensors_of(path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint at ``path`` (see ``_locate``), by name, every header checked; a name
    in two files, or one the index puts in a file whose header lacks it, raises."""
    files, index, weight_map = _locate(path)
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in out:
                raise SafetensorsError(f"tensor {name!r} is in both {out[name].file!r} and {file!r}")
            out[name] = info
    for name, file in weight_map.items():
        if name not in out or os.path.basename(out[name].file) != file:
            raise SafetensorsError(f"index {index!r} says tensor {name!r} is in {file!r}, whose header lacks it")
    return out


class Reader:
    """Open files, read from by ``pread``; ``with Reader() as r:`` closes them."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def read_into(self, info: TensorInfo, out: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Elements ``[first, first + out.numel())`` of ``info``'s tensor, in flat order, into the contiguous
        CPU tensor ``out`` (cast to its dtype); only those bytes are read."""
        count = out.numel()
        if first < 0 or first + count > info.numel:
            raise ValueError(f"elements [{first}, {first + count}) are outside tensor {info.name!r} of "
                             f"{info.numel} elements")
        target = out if out.dtype == info.dtype else torch.empty(count, dtype=info.dtype)
        self._pread(info, target.view(-1).view(torch.uint8), info.start + first * info.dtype.itemsize)
        if target is not out:
            out.view(-1).copy_(target)
        return out

    def read(self, info: TensorInfo, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, shaped, in ``dtype`` (default: its own)."""
        out = torch.empty(info.shape, dtype=dtype or info.dtype)
        return self.read_into(info, out)

    def _pread(self, info: TensorInfo, dest: torch.Tensor, offset: int) -> None:
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        view = memoryview(dest.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:  # the file shrank since its header was read
                raise SafetensorsError(f"safetensors file {info.file!r} is truncated: tensor {info.name!r} ends "
                                       f"past the file's end")
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
