"""Pretrained weights in: which bytes of a safetensors checkpoint make each unit's part.

``step.init(model, weights=PATH)`` reads every parameter and persistent buffer from the
files ``save_pretrained`` wrote (safetensors_reader), by the model's own ``state_dict``
names, as ``model.load_state_dict`` would take them: a tied parameter from whichever of
its names the files hold, each tensor cast to the model's dtype. A unit's flat buffer is
its parameters end to end, and each tensor's bytes in a file are its elements in the same
flat order, so a rank's shard of a unit is a few byte ranges of the files: each rank
reads only those (``read``), and no unit goes through rank 0.

Where the model keeps a tensor in another layout than its checkpoints (transformers 5's
fused experts), transformers' own conversion mapping says which file tensors make it
(hf_keys), still as byte ranges.

A peft model reads its base tensors from its base model's folder, by the base model's names
(peft_keys); the adapters' own tensors are not in it, and peft's init makes them (peft_init), unless
``weights=[BASE, ADAPTER, ...]`` names the folders ``PeftModel.save_pretrained`` wrote: each adapter
tensor (and ``modules_to_save`` copy) is then read from them, by peft's saved names.

What the files lack or hold beyond the model raises, naming the keys (``strict=False``
allows both, as ``load_state_dict(strict=False)``: a missing tensor is initialized as
without weights); so does a tensor whose shape differs from the model's.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import NamedTuple

import torch
from torch import nn

from .. import compiled
from . import hf_keys, peft_keys
from .safetensors_reader import Reader, TensorInfo, tensors_of
from ..tree import ModelSpec, Segment

_SHOWN = 8  # keys named in an error, then a count


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` reports: the model's keys the files lack, the files' keys the model has not."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class WeightsMismatch(UserWarning):
    """``strict=False`` read a checkpoint that lacks some of the model's tensors or holds others;
    ``.incompatible`` says which (``IncompatibleKeys``)."""

    def __init__(self, message: str, incompatible: IncompatibleKeys):
        super().__init__(message)
        self.incompatible = incompatible


class Weights:
    """A checkpoint opened against a model: each of the model's tensors' pieces in the files."""

    def __init__(self, path, model: nn.Module, spec: ModelSpec, strict: bool = True):
        path, *adapter_paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        self.path = os.fspath(path)
        wanted = _state_dict_shapes(model)
        aliases = _aliases(spec)
        self.buffer_names = set(wanted) - set(spec.parameter_names)
        files = tensors_of(self.path)
        names = peft_keys.base_names(model, wanted)  # a peft model: its base tensors by the base model's names
        if names is None and adapter_paths:
            raise ValueError(f"weights: {len(adapter_paths) + 1} paths given, but the model is no peft model: a list "
                             "is a base model's folder then peft adapter folders (PeftModel.save_pretrained's)")
        if names is None:
            sources, missing, unexpected = _match(files, model, wanted, aliases, self.buffer_names)
        else:
            sources, missing, unexpected = _match_peft(files, model, wanted, aliases, self.buffer_names, names)
        for adapter in adapter_paths:  # the adapters' tensors, and modules_to_save copies, over the base's
            unexpected += _match_adapter(os.fspath(adapter), model, wanted, sources)
        if adapter_paths:
            missing = [k for k in _missing(aliases, self.buffer_names, sources)
                       if k in missing or names[k] is None]
        # a peft model's adapter tensors are never missing from a base folder (peft's init makes them:
        # zfunc.weights.peft_init), only from adapter folders given
        shown = missing if names is None else [_in_files(k, names) for k in missing]
        if not sources and wanted and (missing or unexpected):
            raise ValueError(
                f"weights {self.path!r} share no tensor with the model: "
                f"{_named(unexpected, 'tensors the files hold')}; {_named(shown, 'tensors the model needs')}. "
                "Names are the model's state_dict names: load the files into the model they were saved from "
                "(a peft model: its base model's folder), or rename the files' keys")
        if strict and (missing or unexpected):
            raise ValueError(
                f"weights {self.path!r} do not match the model: "
                f"{_named(shown, 'tensors the model needs but the files lack')}; "
                f"{_named(unexpected, 'tensors the files hold but the model has not')}. Names are the model's "
                "state_dict names; pass strict=False to load what matches (the missing ones are initialized "
                "as without weights)")
        for name, pieces in sources.items():
            _check_shape(name, pieces, wanted[name])
        # one source per parameter (its first name the files hold) and per persistent buffer
        self.sources: dict[str, list[tuple[TensorInfo, int, int]]] = {}
        for first, *rest in aliases.values():
            found = next((n for n in (first, *rest) if n in sources), None)
            if found is not None:
                self.sources[first] = sources[found]
        self.sources.update({b: sources[b] for b in self.buffer_names if b in sources})
        self.reader = Reader()
        # as load_state_dict(strict=False) returns it; step.init warns with it
        self.incompatible = IncompatibleKeys(list(missing), list(unexpected))
        if missing or unexpected:
            warnings.warn(WeightsMismatch(
                f"weights {self.path!r} (strict=False): {len(self.sources)} of the model's "
                f"{len(aliases) + len(self.buffer_names)} tensors read; "
                f"{_named(shown, 'missing (initialized as without weights)')}; "
                f"{_named(unexpected, 'unexpected (not read)')}", self.incompatible), stacklevel=_caller())

    def holds(self, seg: Segment) -> bool:
        """Whether the files hold every parameter of ``seg``."""
        return all(e.name in self.sources for e in seg.entries)

    def read(self, seg: Segment, start: int, stop: int, device) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``seg``'s flat buffer (zero padding included), from the files."""
        out = torch.zeros(stop - start, dtype=seg.dtype)
        self.fill(seg, out, start)
        return out if torch.device(device).type == "cpu" else out.to(device)

    def fill(self, seg: Segment, out: torch.Tensor, start: int = 0) -> None:
        """Write the files' values of ``seg``'s parameters over ``out``, which holds elements
        ``[start, start + out.numel())`` of its flat buffer; parameters the files lack are left."""
        if out.device.type != "cpu":
            host = out.cpu()
            self.fill(seg, host, start)
            out.copy_(host)
            return
        stop = start + out.numel()
        for e in seg.entries:
            pieces = self.sources.get(e.name)
            lo, hi = max(e.offset, start), min(e.offset + e.numel, stop)
            if pieces is None or lo >= hi:
                continue
            self._copy(pieces, lo - e.offset, hi - e.offset, out[lo - start : hi - start])

    def holds_tensor(self, name: str) -> bool:
        """Whether the files hold the parameter (by its first name) or buffer ``name``."""
        return name in self.sources

    def holds_buffer(self, name: str) -> bool:
        return name in self.sources and name in self.buffer_names

    def read_tensor(self, name: str, out: torch.Tensor) -> None:
        """Parameter (by its first name) or buffer ``name``'s values from the files into ``out``."""
        self.read_buffer(name, out)

    def read_buffer(self, name: str, out: torch.Tensor) -> None:
        """Buffer ``name``'s values from the files into ``out`` (cast to its dtype)."""
        host = torch.empty(out.shape, dtype=out.dtype)
        self._copy(self.sources[name], 0, out.numel(), host.view(-1))
        out.copy_(host)

    def _copy(self, pieces, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of one model tensor, made of ``pieces``, into ``out``."""
        at = 0  # where the current piece starts in the model tensor
        for info, first, n in pieces:
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                self.reader.read_into(info, out[a - lo : b - lo], first + a - at)
            at += n

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _match(files: dict[str, TensorInfo], model: nn.Module, wanted: dict, aliases: dict, buffer_names: set):
    """``(sources, missing, unexpected)``: the pieces of each model key the files hold, by name or else
    through transformers' conversion mapping (zfunc.weights.hf_keys); the keys none of whose names they hold;
    the file tensors no key takes. Hugging Face's ``_keys_to_ignore_on_load_*`` are neither."""
    sources = {k: [(files[k], 0, files[k].numel)] for k in wanted if k in files}
    missing = _missing(aliases, buffer_names, sources)
    if missing or set(files) - set(wanted):  # perhaps another layout: transformers' mapping, if it has one
        pieces = hf_keys.converted(model, {k: i.shape for k, i in files.items()}, wanted,
                                   {k: i.file for k, i in files.items()})
        if pieces is not None:
            sources = {k: [(files[key], first, n) for key, first, n in p] for k, p in pieces.items()}
            missing = _missing(aliases, buffer_names, sources)
    used = {info.name for pieces in sources.values() for info, _, _ in pieces}
    unexpected = sorted(set(files) - used - hf_keys.ignored(model, files, "unexpected"))
    missing = [k for k in missing if k not in hf_keys.ignored(model, missing, "missing")]
    return sources, missing, unexpected


def _match_peft(files: dict[str, TensorInfo], model: nn.Module, wanted: dict, aliases: dict, buffer_names: set,
                names: dict[str, str | None]):
    """``_match`` for a peft model (zfunc.weights.peft_keys): its base tensors matched by their names in
    the base model (a ``modules_to_save`` copy reads the original's), through the base model's own
    mapping; the adapters' tensors are neither read nor missing."""
    base = peft_keys.base_model(model)
    base_wanted: dict[str, tuple[int, ...]] = {}
    for key, shape in wanted.items():
        if names[key] is not None:
            base_wanted.setdefault(names[key], shape)
    base_buffers = {names[b] for b in buffer_names if names[b] is not None}
    found, _, unexpected = _match(files, base, base_wanted, {b: [b] for b in base_wanted if b not in base_buffers},
                                  base_buffers)
    sources = {k: found[b] for k, b in names.items() if b is not None and b in found}
    ignored = hf_keys.ignored(base, set(base_wanted), "missing")
    missing = [k for k in _missing(aliases, buffer_names, sources) if names[k] is not None and names[k] not in ignored]
    return sources, missing, unexpected


def _match_adapter(path: str, model: nn.Module, wanted: dict, sources: dict) -> list[str]:
    """Sources from the adapter folder ``path`` (``adapter_model.safetensors``, by peft's saved names:
    zfunc.weights.peft_keys.adapter_file_names) for the keys it holds; the tensors it holds that no key takes."""
    files = tensors_of(path)
    taken = set()
    for key, name in peft_keys.adapter_file_names(model, wanted).items():
        if name in files:
            sources[key] = [(files[name], 0, files[name].numel)]
            taken.add(name)
    return sorted(set(files) - taken)


def _in_files(key: str, names: dict[str, str | None]) -> str:
    """A peft model's key as an error names it: with the base model's name the files would hold it by."""
    if names[key] is None:
        return f"{key} (an adapter tensor, which the adapter folders lack)"
    return key if names[key] == key else f"{names[key]} (in the peft model: {key})"


def _caller() -> int:
    """The ``stacklevel`` of the first frame outside zfunc (the user's ``init`` call)."""
    package, level, frame = os.path.dirname(__file__), 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _state_dict_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's ``state_dict`` names (plain: zfunc.compiled) and shapes, tied aliases included."""
    return {compiled.plain_name(k): tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor)}


def _aliases(spec: ModelSpec) -> dict[str, list[str]]:
    """Each parameter's names, its first (the one zfunc keeps) first."""
    out: dict[str, list[str]] = {}
    for name in spec.parameter_names:
        out.setdefault(spec.canonical_name(name), []).append(name)
    return out


def _missing(aliases: dict, buffer_names: set, sources: dict) -> list[str]:
    params = [names[0] for names in aliases.values() if not any(n in sources for n in names)]
    return params + sorted(b for b in buffer_names if b not in sources)


def _check_shape(name: str, pieces, shape: tuple[int, ...]) -> None:
    total = sum(n for _, _, n in pieces)
    [(info, _, _), *rest] = pieces
    whole = not rest and total == info.numel  # the file's tensor itself, not pieces of several
    if total != math.prod(shape) or (whole and info.shape != shape):
        what = f"shape {info.shape}" if whole else f"{total} elements"
        raise ValueError(f"weights: tensor {name!r} has {what} in {info.file!r} but shape {shape} in the model")


def _named(keys: list[str], what: str) -> str:
    if not keys:
        return f"no {what}"
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{len(keys)} {what}: {', '.join(map(repr, keys[:_SHOWN]))}{more}"
