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

import torch
from torch import nn

from . import compiled

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


def converted(model: nn.Module, shapes: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]
              ) -> dict[str, list[Piece]] | None:
    """Model key -> its pieces in the files, through transformers' conversion mapping for ``model``
    (renamings, the base model's prefix added or dropped, experts fused); None where transformers
    has no such mapping (transformers 4, or not a ``PreTrainedModel``).

    ``shapes``: the file tensors' shapes by name; ``wanted``: the model keys' shapes."""
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
    owner_of_row = sorted((start, key) for key, (start, _) in rows.items())
    out = dict(direct)
    for target, conv in fused.items():
        for name, ids in conv.convert(target, model=root, config=root.config).items():
            if name in meta:
                out[name] = _pieces(name, ids, wanted[name], rows, owner_of_row)
    return out


def _pieces(name: str, ids: torch.Tensor, shape: tuple[int, ...], rows: dict, owner_of_row: list) -> list[Piece]:
    """Runs of consecutive source rows in the model tensor's flat order, as element ranges."""
    expected = (*shape[:-1], 1) if shape else (1,)
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
