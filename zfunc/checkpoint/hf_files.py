"""A Hugging Face model folder as ``save_pretrained`` writes it, filled one tensor at a time.

``save_pretrained`` holds the whole ``state_dict`` and hands each shard to ``safetensors``. Here
every tensor's name, shape and dtype are known before its values are (they come from the
model's layout), so each file's header is written first and each tensor's bytes go straight to
their place as they arrive: the caller holds only the tensors it is putting (zfunc: one unit).

The same as ``save_pretrained`` (transformers 5 with huggingface_hub):

- shards: tensors, in the order given, fill a shard until the next would pass
  ``max_shard_size``; a tensor larger than that gets a shard of its own
  (huggingface_hub's ``split_state_dict_into_shards``); sizes as HF takes them
  (bytes, or ``"5GB"``, ``"500MB"``: decimal units);
- names: ``model.safetensors`` when there is one shard, else
  ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
  (``{"metadata": {"total_parameters", "total_size"}, "weight_map"}``);
- each shard byte for byte what ``safetensors.torch.save_file(tensors, path,
  metadata={"format": "pt"})`` writes: an 8-byte length, the JSON header padded
  with spaces to 8 bytes, the data ordered by dtype (widest first) then name;
- ``config.json`` as ``PretrainedConfig.save_pretrained`` writes it, its
  ``dtype`` the one the weights are written in (``from_pretrained`` loads in it).

Each file is written under a temporary name, fsynced and renamed. The entry points of an
earlier export (``model.safetensors``, the index) are removed before the new shards take their
names and the new index is written last, so a kill leaves either the new folder or one that
``from_pretrained`` refuses (no weights), never old and new weights mixed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass

import torch

from .files import fsync_dir, write_text

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's parse_size_to_int
# the names an export's dtype is given by (the CLI's --dtype, zero_to_fp32's dtype=)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# safetensors' dtype names, narrowest first (its Dtype enum's order, by which it sorts a file's data)
_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
_RANK = {d: i for i, d in enumerate(_NAMES)}


@dataclass(frozen=True)
class Planned:
    """A tensor to be written: known before its values."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def parse_size(size: int | str) -> int:
    """Bytes, from an int or a string as Hugging Face takes it: ``"5GB"``, ``"500MB"``, ``"100KB"``."""
    if isinstance(size, int):
        return size
    text = str(size).strip()
    if text.isdigit():
        return int(text)
    unit = text[-2:].upper()
    try:
        return int(float(text[:-2]) * _UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"max_shard_size {size!r}: give bytes (an int) or a number with KB, MB, GB or TB, "
                         "e.g. '5GB' (decimal units, as Hugging Face reads them)") from None


def split(tensors: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Shards in huggingface_hub's way: in order, a new shard when the next tensor would pass
    ``max_bytes``; a tensor larger than ``max_bytes`` alone in one."""
    shards, current, size = [], [], 0
    for t in tensors:
        if t.nbytes > max_bytes:
            shards.append([t])
            continue
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:  # the last one (no tensors at all: one empty file)
        shards.append(current)
    return shards


class SafetensorsFile:
    """One ``.safetensors`` file: its header written at once, each tensor's bytes when ``put``;
    fsynced at ``seal``, under its name at ``publish``."""

    def __init__(self, path: str, tensors: list[Planned]):
        for t in tensors:
            if t.dtype not in _NAMES:
                raise TypeError(f"tensor {t.name!r} is {t.dtype}, which safetensors files here do not hold; "
                                f"export in one of {sorted(str(d) for d in _NAMES)}")
        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"
        ordered = sorted(tensors, key=lambda t: (-_RANK[t.dtype], t.name))
        header, offset, self.at = {"__metadata__": {"format": "pt"}}, 0, {}
        for t in ordered:
            header[t.name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            self.at[t.name] = (t, offset)
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        self.at = {n: (t, start + o) for n, (t, o) in self.at.items()}
        self.left = set(self.at)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite(self.fd, len(text).to_bytes(8, "little") + text, 0)
            os.ftruncate(self.fd, start + offset)
        except BaseException:
            self.abort()
            raise

    def put(self, name: str, value: torch.Tensor) -> None:
        t, offset = self.at[name]
        if tuple(value.shape) != t.shape or value.dtype != t.dtype:
            raise ValueError(f"tensor {name!r} is {tuple(value.shape)} {value.dtype}, but the file's header says "
                             f"{t.shape} {t.dtype}")
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        _pwrite(self.fd, memoryview(data.numpy()), offset)
        self.left.discard(name)

    def seal(self) -> None:
        """fsync the temporary file; raise if a tensor was never put."""
        if self.left:
            raise ValueError(f"{self.path!r}: tensors {sorted(self.left)[:3]} were never written")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None

    def publish(self) -> None:
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:  # a write may be partial (Linux writes at most 2 GiB at once)
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class ModelFolder:
    """The weights (and config) of a Hugging Face model folder; ``put`` each planned tensor, then
    ``close``. ``parameters``: how many parameter elements the tensors hold (the index says it)."""

    def __init__(self, directory: str, tensors: list[Planned], *, max_shard_size: int | str, parameters: int,
                 config: dict | None = None, config_files: dict[str, str] | None = None):
        self.directory = directory
        shards = split(tensors, parse_size(max_shard_size))
        names = ([WEIGHTS] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        self.total_bytes = sum(t.nbytes for t in tensors)
        self.index = {"metadata": {"total_parameters": parameters, "total_size": self.total_bytes},
                      "weight_map": {t.name: n for n, shard in zip(names, shards) for t in shard}}
        self.config, self.config_files = config, dict(config_files or {})
        self.shards = dict(zip(names, shards))
        self.files: dict[str, SafetensorsFile] = {}  # open ones, by shard name
        self.done: list[SafetensorsFile] = []

    def put(self, name: str, value: torch.Tensor) -> None:
        shard_name = self.index["weight_map"][name]
        f = self.files.get(shard_name)
        if f is None:
            f = self.files[shard_name] = SafetensorsFile(os.path.join(self.directory, shard_name),
                                                         self.shards[shard_name])
        f.put(name, value)
        if not f.left:  # complete: its file handle goes
            f.seal()
            self.done.append(self.files.pop(shard_name))

    def close(self) -> None:
        """Publish: config, then the shards under their names, the index last; earlier exports' files
        this one does not use are removed."""
        if self.files or len(self.done) != len(self.shards):
            missing = [n for n in self.shards if n not in {os.path.basename(f.path) for f in self.done}]
            raise ValueError(f"shards {missing[:3]} of {self.directory!r} were not filled: put every planned tensor")
        if self.config is not None:
            write_text(os.path.join(self.directory, CONFIG), json.dumps(self.config, indent=2, sort_keys=True) + "\n")
        for name, source in self.config_files.items():
            shutil.copyfile(source, os.path.join(self.directory, name))
        names = set(self.shards)
        for entry in os.listdir(self.directory):  # old entry points first: no mix of old and new weights
            if entry in (WEIGHTS, INDEX) and entry not in names:
                os.remove(os.path.join(self.directory, entry))
        fsync_dir(self.directory)
        for f in self.done:
            f.publish()
        if len(self.shards) > 1:
            write_text(os.path.join(self.directory, INDEX), json.dumps(self.index, indent=2, sort_keys=True) + "\n")
        for entry in os.listdir(self.directory):
            if _SHARD.fullmatch(entry) and entry not in names:
                os.remove(os.path.join(self.directory, entry))
        fsync_dir(self.directory)

    def abort(self) -> None:
        for f in list(self.files.values()) + self.done:
            f.abort()


def config_dict(config, dtype: torch.dtype) -> tuple[dict, dict[str, str]]:
    """``(config.json's content, other files to copy)`` from a ``PretrainedConfig``, a dict, a folder
    holding ``config.json`` (its ``generation_config.json`` is copied too) or a JSON file; ``dtype``
    set to the weights'."""
    files = {}
    if hasattr(config, "to_diff_dict"):  # a transformers PretrainedConfig: what its save_pretrained writes
        out = config.to_diff_dict()
    elif isinstance(config, dict):
        out = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            generation = os.path.join(path, "generation_config.json")
            if os.path.exists(generation):
                files["generation_config.json"] = generation
            path = os.path.join(path, CONFIG)
        try:
            with open(path) as f:
                out = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config {os.fspath(config)!r}: no {path!r}; give a folder holding "
                                    "config.json, a JSON file, a dict or a PretrainedConfig") from None
    else:
        raise TypeError(f"config must be a transformers PretrainedConfig, a dict, or the path of a folder holding "
                        f"config.json or of a JSON file; got {type(config).__name__}")
    name = str(dtype).removeprefix("torch.")
    out["dtype"] = name
    if "torch_dtype" in out:  # written by transformers before 4.56
        out["torch_dtype"] = name
    return out, files
