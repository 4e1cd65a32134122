"""A Hugging Face checkpoint's names and layouts mapped onto the model's own, as ``from_pretrained`` maps them.

transformers 5 keeps some tensors in a layout its checkpoints do not have: Mixtral's experts are
one fused ``experts.gate_up_proj`` of shape (E, 2I, H), while checkpoints (and ``save_pretrained``,
which writes the original format) hold ``block_sparse_moe.experts.{e}.w1/w3.weight`` per expert.
transformers' own conversion mapping says how to rename keys and which tensors to stack,
concatenate or split into each of the model's. zfunc runs that mapping on *row numbers*
instead of weights: each source tensor stands in as the numbers of its rows (its shape with
the last dimension 1), the mapping's operations move them as they would move rows of weights,
and the result says, for each row of the model's tensor, which file tensor and which row it
comes from. Runs of consecutive rows are then byte ranges of the files, so each rank still
reads only its shards' bytes. An operation that moves elements within a row (a transpose of
the last dimension) cannot be followed this way and raises, naming the key.
"""
from __future__ import annotations

import bisect
import copy
import math
import re
import sys
from collections import Counter

import torch
from torch import nn

from .. import compiled

Piece = tuple[str, int, int]  # (file tensor name, first element, elements), in the model tensor's flat order


def hf_model(model: nn.Module):
    """The ``transformers.PreTrainedModel`` at ``model``'s root (under a compiled wrapper), or None.
    A model of that class means transformers is imported already: nothing is imported here."""
    modeling = sys.modules.get("transformers.modeling_utils")
    root = compiled.owner(model, "")
    return root if modeling is not None and isinstance(root, modeling.PreTrainedModel) else None


def ignored(model: nn.Module, names, which: str) -> set[str]:
    """Of ``names``, those the model's ``_keys_to_ignore_on_load_{which}`` patterns match (Hugging Face
    lets a checkpoint lack or hold these: GPT-2's old ``attn.bias`` masks)."""
    root = hf_model(model)
    patterns = getattr(root, f"_keys_to_ignore_on_load_{which}", None) or ()
    return {n for n in names if any(re.search(p, n) for p in patterns)}


def converted(model: nn.Module, shapes: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]],
              files: dict[str, str] | None = None) -> dict[str, list[Piece]] | None:
    """Model key -> its pieces in the files, through transformers' conversion mapping for ``model``
    (renamings, the base model's prefix added or dropped, experts fused); None where transformers
    has no such mapping (transformers 4, or not a ``PreTrainedModel``).

    ``shapes``: the file tensors' shapes by name; ``wanted``: the model keys' shapes; ``files``: the
    file each tensor is in (named in errors). Tensors fused into one (experts) must all be there, in
    one shape: else the error names the one missing or misshaped, its file and the shape expected."""
    files = files or {}
    root = hf_model(model)
    if root is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:
        return None
    mapping = get_model_conversion_mapping(root)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = {k: torch.empty(s, device="meta") for k, s in wanted.items()}  # what rename_source_key consults
    prefix = root.base_model_prefix
    rows: dict[str, tuple[int, int]] = {}  # file tensor -> (its first row number, its row length)
    first_row = 0
    direct: dict[str, list[Piece]] = {}
    fused: dict[str, object] = {}
    members: dict[str, list[tuple[str, str]]] = {}  # target -> its (source pattern, file tensor)s
    for key in sorted(shapes, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = rename_source_key(key, [], [], prefix, meta)
        if target not in meta:
            continue
        shape = shapes[key]
        if pattern is None:
            direct[target] = [(key, 0, math.prod(shape))]
            continue
        n_rows, length = math.prod(shape[:-1]), (shape[-1] if shape else 1)
        rows[key] = (first_row, length)
        ids = torch.arange(first_row, first_row + n_rows).reshape(*shape[:-1], 1)
        first_row += n_rows
        conv = fused.setdefault(target, copy.deepcopy(by_pattern[pattern]))
        conv.add_tensor(target, key, pattern, ids)
        members.setdefault(target, []).append((pattern, key))
    owner_of_row = sorted((start, key) for key, (start, _) in rows.items())
    out = dict(direct)
    for target, conv in fused.items():
        sources = members[target]
        _check_sources(target, conv, sources, shapes, wanted[target], files)
        try:
            made = conv.convert(target, model=root, config=root.config)
        except Exception as e:  # transformers' own error names no tensor: name them
            raise ValueError(f"weights: transformers' conversion of {_listed([k for _, k in sources], shapes, files)} "
                             f"into {target!r} (shape {wanted[target]} in the model) failed: {e}") from None
        for name, ids in made.items():
            if name in meta:
                out[name] = _pieces(name, ids, wanted[name], rows, owner_of_row, [k for _, k in sources], shapes, files)
    return out


def _check_sources(target: str, conv, sources: list[tuple[str, str]], shapes: dict, shape: tuple, files: dict) -> None:
    """Each source pattern of ``target`` holds tensors of one shape, for the same experts, none missing
    (every expert of the model's tensor where the conversion stacks them along its first dimension)."""
    by_pattern: dict[str, list[str]] = {}
    for pattern, key in sources:
        by_pattern.setdefault(pattern, []).append(key)
    for keys in by_pattern.values():
        common = Counter(shapes[k] for k in keys).most_common(1)[0][0]
        for k in keys:
            if shapes[k] != common:
                raise ValueError(
                    f"weights: tensor {k!r} in {files.get(k, 'the files')!r} has shape {shapes[k]}, but "
                    f"transformers' conversion stacks it with {len(keys) - 1} others of shape {common} into "
                    f"{target!r} (shape {shape} in the model): expected shape {common}; the file is damaged or "
                    "was saved from another config")
    varying = _varying([k for _, k in sources])
    stacked = any(type(op).__name__ == "MergeModulelist" and getattr(op, "dim", None) == 0 for op in conv.operations)
    index = {k: tuple(_numbers(k)[i] for i in varying) for _, k in sources}
    expected = set(index.values())
    if stacked and shape and all(len(i) == 1 for i in expected):
        expected |= {(e,) for e in range(shape[0])}
    for keys in by_pattern.values():
        have = {index[k] for k in keys}
        lost = sorted(expected - have)
        if lost:
            like = keys[0]
            name = _with_numbers(like, varying, lost[0])
            more = f" (and {len(lost) - 1} more of its kind)" if len(lost) > 1 else ""
            raise ValueError(
                f"weights: tensor {name!r} (shape {shapes[like]}){more} is missing from the files ({files.get(like, 'the checkpoint')!r} "
                f"holds {like!r}): transformers' conversion stacks {len(expected)} tensors of shape {shapes[like]} "
                f"into {target!r} (shape {shape} in the model), and a fused tensor is read whole or not at all. "
                "Restore it, or (strict=False) leave out every tensor that makes it, so that it is initialized "
                "as without weights")


def _numbers(key: str) -> list[int]:
    return [int(part) for part in key.split(".") if part.isdigit()]


def _varying(keys: list[str]) -> list[int]:
    """Which of the keys' numbered name parts differ between them (an expert's number, not its layer's)."""
    numbers = [_numbers(k) for k in keys]
    n = min(map(len, numbers))
    return [i for i in range(n) if len({ns[i] for ns in numbers}) > 1]


def _with_numbers(key: str, varying: list[int], values: tuple[int, ...]) -> str:
    """``key`` with its ``varying`` numbered parts set to ``values``."""
    parts, at = key.split("."), 0
    new = dict(zip(varying, values))
    for i, part in enumerate(parts):
        if part.isdigit():
            if at in new:
                parts[i] = str(new[at])
            at += 1
    return ".".join(parts)


def _listed(keys: list[str], shapes: dict, files: dict, shown: int = 4) -> str:
    named = ", ".join(f"{k!r} {shapes[k]} in {files.get(k, '?')!r}" for k in keys[:shown])
    return f"the files' {len(keys)} tensors {named}" + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def _pieces(name: str, ids: torch.Tensor, shape: tuple[int, ...], rows: dict, owner_of_row: list,
            keys: list[str], shapes: dict, files: dict) -> list[Piece]:
    """Runs of consecutive source rows in the model tensor's flat order, as element ranges."""
    expected = (*shape[:-1], 1) if shape else (1,)
    if tuple(ids.shape) != expected and ids.shape[-1:] == (1,):
        raise ValueError(
            f"weights: transformers' conversion of {_listed(keys, shapes, files)} makes {name!r} of shape "
            f"{(*ids.shape[:-1], shape[-1] if shape else 1)}, but the model's is {tuple(shape)}: the files lack "
            "some of its tensors or hold them for another config")
    if tuple(ids.shape) != expected:
        raise ValueError(
            f"transformers' conversion of the checkpoint into {name!r} (shape {tuple(shape)}) moves elements "
            "within rows, which zfunc cannot read as byte ranges: build the model with from_pretrained and pass "
            "it built, or save it with save_pretrained(..., save_original_format=False)")
    length = shape[-1] if shape else 1
    starts = [s for s, _ in owner_of_row]
    pieces: list[Piece] = []
    flat = ids.reshape(-1).tolist()
    i = 0
    while i < len(flat):
        j = i + 1
        while j < len(flat) and flat[j] == flat[j - 1] + 1:
            j += 1
        start = flat[i]
        k = bisect.bisect_right(starts, start) - 1
        key = owner_of_row[k][1]
        first, src_len = rows[key]
        if src_len != length:
            raise ValueError(f"transformers' conversion of the checkpoint into {name!r} joins rows of {src_len} "
                             f"elements ({key!r}) into rows of {length}: cannot be read in byte ranges")
        # a run may cross from one source tensor into the next: cut it at their boundary
        if k + 1 < len(owner_of_row):
            j = min(j, i + owner_of_row[k + 1][0] - start)
        pieces.append((key, (start - first) * length, (j - i) * length))
        i = j
    return pieces
