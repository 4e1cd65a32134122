"""Checkpoints: each rank writes its own shards, rank 0 a manifest; load at any world size,
into any composition of transforms.

A checkpoint is a folder ``DIR/TAG/``::

    manifest.json     rank 0: the model's layout (units, parameter names and shapes),
                      each part's flat layout per unit (elements, sharded or whole,
                      dtype), the world size, the composition, the step count, the
                      tag and whatever the caller adds (config, engine counters)
    rank{r}.bin       rank r's bytes: its shard of every sharded unit (parameters,
                      master weights, moments); rank 0 also the whole-buffer units
                      and the other tensors (step counters, loss scale, buffers)
    rank{r}.json      the index of rank{r}.bin (with a checksum per chunk), and rank r's RNG state

Parts are named by what they hold, not by where the composition keeps them:
``params``, ``master`` (mixed precision's fp32 weights), ``opt_state.mu``,
``frozen``, ``buffers['bn.running_mean']``, ``count``; offload's and mixed
precision's wrappers are not in the names. So a checkpoint loads into any
composition of the same model and optimizer (ZeRO stage 0-3, ``offload_cpu``,
``offload_nvme``, mixed precision on or off) at any world size: the
parameters and the moments are the same numbers wherever they live. Without
mixed precision the fp32 parameters come from a checkpoint's master weights
when it has them; with it, the master weights come from the checkpoint's
master weights, or from its fp32 parameters (the low-precision ones cast).

Every tensor goes in as raw bytes, one unit at a time, so a state whose tensors
live in swap files (``offload_nvme``) is written without ever being whole in RAM.
Every file is checksummed and every read verified (``files``); a save
killed at any instant leaves ``latest`` and every tag naming a complete
checkpoint (``folders``). Free space is checked on every rank before
writing.

Loading rebuilds each unit's flat buffer from the saved shards (any saved world
size), pads it for the current one and keeps this rank's shard, one unit at a
time: resharding is a by-product of storing flat layouts (``load``). Every byte
a rank will read is verified before anything is copied into the state.
``python -m zfunc.checkpoint consolidate DIR OUT.pt`` writes one fp32
``state_dict`` that ``model.load_state_dict`` accepts (``--safetensors``: one
``.safetensors`` file in Hugging Face's form, tied weights once).

Hugging Face: ``save_hf(state, OUT)`` and ``python -m zfunc.checkpoint export-hf DIR
OUT`` (``export_hf``) write the folder ``save_pretrained`` would, one unit in memory
at a time (``hf_export``, ``hf_files``).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

import optree
import torch

from . import folders
from .. import dist, layout, swap
from .files import (DamagedCheckpointError, RankFile, Writer, damaged, dtype_of, free_space_error, read_json,
    write_json, write_text)
from .hf_export import entry_offsets, export_saved
from ..optim.counts import is_count
from ..pytree import NAMESPACE, tree_unflatten
from ..state import INNER, check_usable, wrapper_role
from ..tree import ModelSpec, Params, compact_held, expand_held

FORMAT = 3  # 1: no checksums, parts named by their path in the composition's state; 2: a step count per unit
READS = (2, 3)  # a format-2 unit count loads into each of the unit's parameters' counts
resolve = folders.resolve


# ------------------------------------------------------------------ the state's parts


def _parts(state) -> tuple[list[str], list[Any], Any]:
    """``(roles, nodes, treedef)``: every ``Params`` node and every other leaf of ``state``, each
    named by what it holds (``_role``)."""
    accessors, nodes, treedef = optree.tree_flatten_with_accessor(state, is_leaf=lambda x: isinstance(x, Params),
                                                                  namespace=NAMESPACE)
    return [_role(a) for a in accessors], nodes, treedef


def _role(accessor) -> str:
    """A part's path in the state without the wrappers a composition adds: ``opt_state.inner.inner.mu``
    under ``offload_cpu(mixed_precision(...))`` is ``opt_state.mu`` as in a plain ``train_step``; the
    fp32 master weights are ``master``; offload's host copy of the parameters is ``params``."""
    kept = []
    for e in accessor:
        fields = getattr(e.type, "_fields", ())
        role = wrapper_role(e.type, fields[e.entry]) if isinstance(e.entry, int) and e.entry < len(fields) else None
        if role == INNER:
            continue
        if role is not None:  # a wrapper's master weights, or offload's host copy of the parameters
            return role
        kept.append(e)
    return optree.PyTreeAccessor(tuple(kept)).codify("").lstrip(".")


def _is_whole(t: torch.Tensor, sharded: bool) -> bool:
    """A leaf every rank holds the same of: a whole buffer, or a unit's step counts."""
    return not sharded or is_count(t)


def _numel(t: torch.Tensor, seg) -> int:
    """A unit's leaf's elements as the manifest records them: its unpadded flat buffer's, its step
    counts' (one per parameter), or 0 for a 0-d count (one per unit, format 2)."""
    if not t.dim():
        return 0
    return t.numel() if is_count(t) else seg.numel


def _settle(state) -> None:
    """Wait for writes behind the last step (offload_nvme), so the files hold the latest values."""
    store = swap.open_store(state)
    if store is not None:
        store.settle()


def model_layout(spec: ModelSpec) -> dict:
    """The model's layout as plain data: what a checkpoint must match to load."""

    def segment(s):
        return {"numel": s.numel, "dtype": str(s.dtype), "entries": [[e.name, list(e.shape)] for e in s.entries],
                "offsets": [e.offset for e in s.entries]}

    return {"units": [{"name": u.name, "trainable": segment(u.trainable), "frozen": segment(u.frozen)}
                      for u in spec.units],
            "aliases": [list(a) for a in spec.canonical]}


def _first_difference(saved: dict, ours: dict) -> str | None:
    """What differs between two model layouts, in words: the first parameter whose name or shape
    differs (another model), else the first unit grouped otherwise (another unit policy)."""
    def params(lay):
        return [(n, tuple(s)) for u in lay["units"] for kind in ("trainable", "frozen") for n, s in u[kind]["entries"]]

    a, b = params(saved), params(ours)
    theirs, mine, other = dict(a), dict(b), "it was saved from another model: parameter"
    for name, shape in a:
        if name not in mine:
            return f"{other} {name!r} {shape} is in the checkpoint but not in this model"
        if mine[name] != shape:
            return f"{other} {name!r} has shape {shape} in the checkpoint but {mine[name]} in this model"
    for name, shape in b:
        if name not in theirs:
            return f"{other} {name!r} {shape} is in this model but not in the checkpoint"
    if _grouping(saved["units"]) != _grouping(ours["units"]):
        return _unit_difference(saved["units"], ours["units"])
    if saved["aliases"] != ours["aliases"]:
        return "it was saved from the same parameters under other tied (aliased) names"
    return None


def _grouping(units: list) -> list:
    """The units without where their entries lie (an owner layout's depends on the world size:
    ``_remapped`` reads across)."""
    return [{**u, **{k: {f: v for f, v in u[k].items() if f not in ("numel", "offsets")} for k in ("trainable", "frozen")}}
            for u in units]


def _remapped(ours, theirs: dict, start: int, n: int) -> list[tuple[int, int, int]] | None:
    """Elements ``[start, start + n)`` of our segment ``ours`` as ``(lo, hi, at)``: ``[lo, hi)`` of them
    are the saved segment's (``theirs``, a manifest's) ``[at, at + hi - lo)``; None where both lay their
    entries out alike (owner layouts for other world sizes do not: zfunc.tree._segment)."""
    saved = entry_offsets(theirs)
    if [e.offset for e in ours.entries] == saved:
        return None
    out = []
    for e, at in zip(ours.entries, saved):
        a, b = max(e.offset, start), min(e.offset + e.numel, start + n)
        if a < b:
            out.append((a - start, b - start, at + a - e.offset))
    return out


def _unit_difference(saved: list, ours: list) -> str:
    """The same parameters grouped into other units (another unit policy): the first unit that differs."""
    def held(u):
        return [n for kind in ("trainable", "frozen") for n, _ in u[kind]["entries"]]

    head = (f"it holds the same parameters, grouped into other units (another unit policy): {len(saved)} units "
            f"in the checkpoint, {len(ours)} here")
    for i, (a, b) in enumerate(zip(saved, ours)):
        if (a["name"], held(a)) != (b["name"], held(b)):
            return (f"{head}; unit {i} is {a['name'] or '<root>'!r} holding {_few(held(a))} in the checkpoint, "
                    f"{b['name'] or '<root>'!r} holding {_few(held(b))} here")
    return head


def _few(names: list, n: int = 3) -> str:
    return str(names) if len(names) <= n else f"{names[:n]} and {len(names) - n} more"


def _mismatch(saved, composition, world: int, what: str) -> ValueError:
    """The error for a checkpoint that cannot load into this state: ``what`` cannot be bridged, next to
    everything else that differs (world size, transforms), which ``load`` reshards or converts."""
    theirs = saved.manifest.get("composition")
    handled, same = [], []
    (handled if saved.world != world else same).append(
        f"world size {saved.world} in the checkpoint, {world} here" if saved.world != world else f"world size {world}")
    (handled if theirs != composition else same).append(
        f"transforms {theirs} in the checkpoint, {composition} here" if theirs != composition
        else f"transforms {composition}")
    return ValueError(
        f"checkpoint {saved.folder!r} cannot load into this state: {what}. "
        + (f"Also different, which load would reshard or convert: {'; '.join(handled)}. " if handled else "")
        + (f"The same on both sides: {' and '.join(same)}. " if same else "")
        + "load reshards what it can (any world size, ZeRO stage, offload and mixed precision), but needs the same "
        "model (parameter names and shapes, grouped into the same units), the same optimizer and the same buffers")


# ------------------------------------------------------------------------- saving


def _home(node: Params, i: int, t: torch.Tensor) -> int:
    """Elements of unit ``i``'s leaf laid out like the parameters: ``t``'s own, or for a state held for some
    parameters only (zfunc.optim.held), the parameters' leaf's (this rank's shard, or the whole buffer)."""
    if node.spec.held is None or is_count(t) or not t.dim():
        return t.numel()
    return layout.home_numel(node.spec.segment(i).padded, dist.world_size(node.spec.process_group), node.spec.sharded[i])


def _as_laid_out(node: Params, i: int, t: torch.Tensor) -> torch.Tensor:
    """Unit ``i``'s leaf ``t`` (in RAM) laid out like the parameters' leaf: a held state's expanded,
    with zeros for the parameters it holds nothing of, so a checkpoint is the same either way."""
    n = _home(node, i, t)
    if n == t.numel() and node.spec.held is None:
        return t
    return expand_held(node.spec, i, t, node.leaf_start(i), n)


def _bytes_to_write(nodes, rank: int) -> int:
    total = 0
    for node in nodes:
        if isinstance(node, Params):
            for i, (t, sharded) in enumerate(zip(node.leaves, node.spec.sharded)):
                if t is not None and (rank == 0 or not _is_whole(t, sharded)):
                    total += _home(node, i, t) * t.element_size()
        elif isinstance(node, torch.Tensor) and rank == 0:
            total += node.numel() * node.element_size()
    return total


def _check_space(folder: str, need: int, group) -> None:
    """Raise on every rank if any rank lacks room: no rank starts writing a save that cannot finish."""
    error = free_space_error(folder, need, "a checkpoint")
    short = torch.tensor([float(error is not None)], dtype=torch.float64, device=dist.device_of(group))
    dist.all_reduce_sum(short, group)
    if error is not None:
        raise error
    if short.item():
        raise OSError(28, f"not enough free space for a checkpoint in {folder!r} on another rank (its error says "
                          "how much); nothing was written, the previous checkpoint is intact")


def _from_lead(value: int, lead: bool, group) -> int:
    """The ``value`` of the rank that writes the manifest (``lead``), on every rank of ``group``."""
    out = torch.tensor([float(value if lead else 0)], dtype=torch.float64, device=dist.device_of(group))
    return int(dist.all_reduce_sum(out, group).item())


def _writers(state, group) -> tuple[bool, int, int]:
    """``(whether this rank writes, the index of its file, how many files)``. Flat: every rank of
    ``group`` writes its own. Hybrid sharding (zero's ``mesh=``): only the first replica's ranks write,
    one file per rank of the shard group, so the checkpoint is the one a flat run over the shard
    group writes, and no rank writes what another holds the same copy of."""
    key = next((p.replicate for p in state.params.spec.placements if p.replicate is not None), None)
    if key is None:
        return True, dist.rank(group), dist.world_size(group)
    shard = state.params.spec.process_group
    return dist.rank(dist.group_of(key)) == 0, dist.rank(shard), dist.world_size(shard)


def save(state, directory: str, tag: str, *, extra: dict | None = None, group=None,
         files: dict[str, bytes] | None = None) -> str:
    """Write ``state`` as checkpoint ``tag`` in ``directory`` (every rank calls it); return its folder
    (``directory/tag``, or ``directory/tag.rN`` while an older save of the same tag is replaced).

    ``extra``: plain data for the manifest (the engine's counters, its config); ``files``: more files
    for the folder, name to bytes, written with the manifest (a caller's ``client_state``).
    """
    writes, r, w = _writers(state, group)  # r: this rank's file; w: the files
    lead = writes and r == 0  # writes the manifest
    folders.check_tag(tag)
    with contextlib.suppress(OSError):
        _settle(state)  # a write that failed leaves the swap files refused, just below
    check_usable(state, collective=True, group=group)  # a failed update: refused on every rank, writing nothing
    os.makedirs(directory, exist_ok=True)
    roles, nodes, _ = _parts(state)
    _check_space(directory, _bytes_to_write(nodes, r) if writes else 0, group)
    if lead:
        folders.prepare(directory, tag)
    final = folders.name(tag, _from_lead(folders.free_name(directory, tag) if lead else 0, lead, group))
    staging = folders.staging(directory, tag)
    if writes:
        layouts = _write(roles, nodes, os.path.join(staging, f"rank{r}.bin"), r)
    dist.barrier(group)  # every rank's files are complete
    if lead:
        spec = state.params.spec.model
        manifest = {"format": FORMAT, "tag": tag, "saved_ns": time.time_ns(), "world": w,
                    "composition": None if state.plan is None else state.plan.composition,
                    "count": int(state.count), "model": model_layout(spec), "layouts": layouts,
                    "transient_buffers": list(spec.transient_buffers), **(extra or {})}
        for name, data in (files or {}).items():
            write_text(os.path.join(staging, name), data)
        write_json(os.path.join(staging, folders.MANIFEST), manifest)
        folders.publish(directory, tag, final)
    dist.barrier(group)
    return os.path.join(directory, final)


def _write(roles, nodes, path: str, r: int) -> dict:
    """Write file ``r`` (``path``): the shards of every part, and where ``r`` is 0 the whole ones and
    the other tensors; returns the parts' layouts for the manifest."""
    writer = Writer(path)
    layouts = {}
    for role, node in zip(roles, nodes):
        if role in layouts:  # offload's host copy of the parameters: the same numbers as ``params``
            continue
        if isinstance(node, Params):
            units = []
            for i, (t, sharded) in enumerate(zip(node.leaves, node.spec.sharded)):
                seg = node.spec.segment(i)
                if t is None:
                    units.append(None)
                    continue
                whole = _is_whole(t, sharded)
                units.append({"numel": _numel(t, seg), "sharded": not whole, "dtype": str(t.dtype)})
                if r == 0 or not whole:
                    writer.add(f"{role}#{i}", _as_laid_out(node, i, swap.load(t)))  # one unit in RAM at a time
            layouts[role] = units
        elif isinstance(node, torch.Tensor):
            if r == 0:
                writer.add(role, node)
            layouts[role] = "tensor"
        else:
            layouts[role] = {"value": node}
    rng = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state().tolist()
    writer.close({"rank": r, "rng": rng})
    return layouts


# ------------------------------------------------------------------------ loading


class Saved:
    """A checkpoint's manifest and its ranks' tensors, read lazily (memory-mapped) and verified."""

    def __init__(self, folder: str):
        self.folder = folder
        self.manifest = read_json(os.path.join(folder, folders.MANIFEST))
        if self.manifest.get("format") not in READS:
            raise ValueError(f"{folder!r}: checkpoint format {self.manifest.get('format')}, this zfunc reads "
                             f"{' and '.join(map(str, READS))} (format 1 came without checksums: load it with the "
                             "zfunc that wrote it, and save it again with this one)")
        self.world = self.manifest["world"]
        self.layouts = self.manifest["layouts"]
        self.files = [RankFile(folder, k) for k in range(self.world)]

    def _pieces(self, role: str, i: int, start: int, n: int):
        """``(rank file, key, lo, hi, at)``: elements ``[lo, hi)`` of a saved tensor that hold elements
        ``[at, at + hi - lo)`` of ``[start, start + n)`` of unit ``i``'s unpadded flat buffer."""
        lay, key = self.layouts[role][i], f"{role}#{i}"
        if not self.files[0].entry(key)["shape"]:  # a 0-d per-unit counter
            return [(self.files[0], key, 0, 1, 0)]
        stop = min(start + n, lay["numel"])
        if not lay["sharded"]:
            return [(self.files[0], key, start, stop, 0)] if stop > start else []
        shard = math.prod(self.files[0].entry(key)["shape"])
        pieces, pos = [], start
        while pos < stop:
            k, offset = layout.owner(pos, shard)
            take = min(shard - offset, stop - pos)
            pieces.append((self.files[k], key, offset, offset + take, pos - start))
            pos += take
        return pieces

    def check(self, role: str, i: int | None, start: int, n: int) -> None:
        """Verify the bytes ``read_into(role, i, ..., start)`` of ``n`` elements will read (``i`` None:
        all of the tensor ``role``)."""
        if i is None:
            return self.files[0].verify(role)
        for file, key, lo, hi, _ in self._pieces(role, i, start, n):
            file.verify(key, lo, hi)

    def read_into(self, role: str, i: int, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Elements ``[start, start + len(out))`` of unit ``i``'s unpadded flat buffer in the Params part
        ``role`` (any saved world size; zeros past its end) into ``out``, cast to its dtype: only the saved
        shards that overlap are read, so a load at the saved world size reads just this rank's file.
        A saved 0-d count (format 2's, one per unit) goes into every element of ``out``."""
        if out.dim() == 0 or not self.files[0].entry(f"{role}#{i}")["shape"]:
            [(file, key, *_)] = self._pieces(role, i, 0, 1)
            return out.copy_(file.view(key))
        done = 0
        for file, key, lo, hi, at in self._pieces(role, i, start, out.numel()):
            out[at: at + hi - lo].copy_(file.view(key, lo, hi))
            done = at + hi - lo
        out[done:].zero_()  # padding
        return out

    def unit(self, role: str, i: int) -> torch.Tensor:
        """Unit ``i`` of the Params part ``role``: its whole unpadded flat buffer (or 0-d counter)."""
        lay = self.layouts[role][i]
        shape = lay["numel"] if self.files[0].entry(f"{role}#{i}")["shape"] else ()
        return self.read_into(role, i, torch.empty(shape, dtype=dtype_of(lay["dtype"])))

    def tensor(self, role: str) -> torch.Tensor:
        return self.files[0].view(role).clone()

    def release(self) -> None:
        """Drop what was read of the files from this process's memory (``RankFile.release``)."""
        for f in self.files:
            f.release()

    def rng(self, rank: int) -> dict:
        return self.files[rank if rank < self.world else 0].meta["rng"]


def _dtype(node) -> str | None:
    """The dtype of a Params part's units (of a saved layout's), as a string."""
    if isinstance(node, Params):
        return next((str(t.dtype) for t in node.leaves if t is not None and t.dim()), None)
    return next((u["dtype"] for u in node if u is not None and u["numel"]), None)


def _kind(node) -> str:
    if isinstance(node, (Params, list)):
        return "params"
    return "tensor" if isinstance(node, torch.Tensor) or node == "tensor" else "value"


def _sources(roles: list[str], nodes: list, saved: Saved, composition, world: int) -> list[str | None]:
    """The saved part each of ours loads from (None: keep ours), or a clear error when the
    checkpoint holds another optimizer's state (or other buffers)."""
    layouts = saved.layouts
    out, ours_only = [], []
    for role, node in zip(roles, nodes):
        src = role
        if role == "master":
            src = "master" if "master" in layouts else "params"
        elif role == "params" and "master" in layouts and _dtype(node) != _dtype(layouts["params"]):
            src = "master"  # the fp32 values, cast to ours
        elif role.startswith("loss_scale") and role not in layouts:
            src = None  # saved without fp16's loss scaler: ours starts afresh
        if src is not None and (src not in layouts or _kind(layouts[src]) != _kind(node)):
            ours_only.append(role)
        out.append(src)
    theirs_only = [r for r in layouts if r not in roles and r != "master" and not r.startswith("loss_scale")]
    if ours_only or theirs_only:
        raise _mismatch(saved, composition, world,
                        f"their optimizer states or buffers differ (here only: {ours_only}; in the checkpoint only: "
                        f"{theirs_only}): it was saved with another optimizer (or other buffers)")
    return out


def _verified(reads, folder: str, group) -> None:
    """Verify every byte this rank will read; raise on every rank if any rank found damage."""
    error = None
    try:
        for src, role, j, start, n in reads:
            src.check(role, j, start, n)
    except DamagedCheckpointError as e:
        error = e
    bad = torch.tensor([float(error is not None)], dtype=torch.float64, device=dist.device_of(group))
    dist.all_reduce_sum(bad, group)
    if error is not None:
        raise error
    if bad.item():
        raise damaged(folder, None, "has a damaged file, which another rank found (its error names it)")


def load(state, directory: str, tag: str | None = None, *, group=None, sources=None):
    """Copy checkpoint ``directory/tag`` into ``state`` (built by the step that will use it: any
    composition of the same model and optimizer, any world size); returns ``(state, manifest)``.
    Every rank calls it.

    ``sources``: ``(primary, locate)`` for a state whose units were saved in several
    checkpoints (pipeline stages cut elsewhere): ``locate(unit) -> (Saved, its unit there)``;
    ``primary`` (a ``Saved``) gives everything that is not per unit (step counters, buffers)."""
    spec = state.params.spec.model
    composition = None if state.plan is None else state.plan.composition
    world = dist.world_size(state.params.spec.process_group)
    if sources is None:
        saved = Saved(resolve(directory, tag))
        difference = _first_difference(saved.manifest["model"], model_layout(spec))
        if difference is not None:
            raise _mismatch(saved, composition, world, difference)

        def locate(i):
            return saved, i
    else:
        saved, locate = sources
        ours = model_layout(spec)["units"]
        for i, unit in enumerate(ours):
            src, j = locate(i)
            theirs = src.manifest["model"]["units"][j]
            for kind in ("trainable", "frozen"):
                a, b = [s for _, s in theirs[kind]["entries"]], [s for _, s in unit[kind]["entries"]]
                if a != b:
                    raise ValueError(f"unit {unit['name']!r} holds shapes {b} here but {a} in {src.folder!r}: "
                                     "the checkpoint was saved from another model")
    manifest = saved.manifest
    roles, nodes, treedef = _parts(state)
    from_roles = _sources(roles, nodes, saved, composition, world)
    # every read, as (checkpoint, saved part, its unit, first element, elements), verified before any copy
    reads, plans = [], []
    for src_role, node in zip(from_roles, nodes):
        if isinstance(node, Params):
            r = dist.rank(node.spec.process_group)
            for i, (leaf, sharded) in enumerate(zip(node.leaves, node.spec.sharded)):
                if leaf is None or (leaf.dim() and not leaf.numel()):
                    continue
                # this rank's part of the unit laid out for this world size: its shard, or all of it
                n = _home(node, i, leaf)  # a held state's is read laid out like the parameters, then compacted
                start = layout.shard_start(r, n) if not _is_whole(leaf, sharded) else 0
                src, j = locate(i)
                theirs = src.manifest["model"]["units"][j]["frozen" if node.spec.frozen else "trainable"]
                pieces = None if is_count(leaf) else _remapped(node.spec.segment(i), theirs, start, n)
                plans.append((src, src_role, j, start, pieces))
                reads += ([(src, src_role, j, start, n)] if pieces is None
                          else [(src, src_role, j, at, hi - lo) for lo, hi, at in pieces])
    wholes = [(saved, role, None, 0, 0) for role, node in zip(from_roles, nodes)
              if isinstance(node, torch.Tensor) and role is not None]
    _verified(reads + wholes, saved.folder, group)
    store = swap.open_store(state)
    if store is not None:
        store.drop_resident()  # the files are about to change under it
    out, plans = [], iter(plans)
    for src_role, node in zip(from_roles, nodes):
        if isinstance(node, Params):
            for i, leaf in enumerate(node.leaves):
                if leaf is None or (leaf.dim() and not leaf.numel()):
                    continue
                src, role, j, start, pieces = next(plans)
                n = _home(node, i, leaf)
                held = n != leaf.numel() or (node.spec.held is not None and not is_count(leaf) and leaf.dim())
                target = (torch.empty(n, dtype=leaf.dtype) if held or swap.on_disk(leaf) else leaf)
                if pieces is None:
                    src.read_into(role, j, target, start)
                else:  # saved in another owner layout: entry by entry, zeros between
                    target.zero_()
                    for lo, hi, at in pieces:
                        src.read_into(role, j, target[lo:hi], at)
                if held:  # a state held for some parameters only: their elements (zfunc.optim.held)
                    target = compact_held(node.spec, i, target, node.leaf_start(i),
                                          out=None if swap.on_disk(leaf) else leaf)
                if swap.on_disk(leaf):
                    store_of_leaf, _, _ = swap.locate(leaf)
                    store_of_leaf.write_now(target, leaf)
            out.append(node)
        elif isinstance(node, torch.Tensor):
            if src_role is not None:
                node.copy_(saved.files[0].view(src_role).view(node.shape))  # stored flat: a factor (32, 1) too
            out.append(node)
        else:
            out.append(node if src_role is None else saved.layouts[src_role]["value"])
    rng = saved.rng(dist.rank(group))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))
    dist.barrier(group)
    return tree_unflatten(treedef, out), manifest


# -------------------------------------------------------------------- consolidate


def consolidate(directory: str, tag: str | None = None, *, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """One fp32 ``state_dict`` (parameters, tied names too, and persistent buffers) from a checkpoint;
    ``exclude_frozen``: without the parameters that did not train."""
    saved = Saved(resolve(directory, tag))
    manifest = saved.manifest
    units = manifest["model"]["units"]
    out: dict[str, torch.Tensor] = {}
    trainable = "master" if "master" in manifest["layouts"] else "params"  # the fp32 weights
    kinds = ((trainable, "trainable"),) if exclude_frozen else ((trainable, "trainable"), ("frozen", "frozen"))
    frozen = {name for unit in units for name, _ in unit["frozen"]["entries"]} if exclude_frozen else set()
    for path, kind in kinds:
        for i, unit in enumerate(units):
            entries = unit[kind]["entries"]
            if not entries:
                continue
            flat = saved.unit(path, i).float()
            for (name, shape), offset in zip(entries, entry_offsets(unit[kind])):
                out[name] = flat[offset: offset + math.prod(shape)].reshape(shape).clone()
    for alias, canonical in manifest["model"]["aliases"]:
        if canonical not in frozen:
            out[alias] = out[canonical]
    transient = set(manifest.get("transient_buffers", ()))  # not in the model's state_dict
    for path, lay in manifest["layouts"].items():
        name = path[len("buffers['"): -len("']")]
        if path.startswith("buffers['") and lay == "tensor" and name not in transient:
            out[name] = saved.tensor(path)
    keys = manifest.get("state_dict_keys")
    if keys is None:
        return out
    aliases = dict(manifest["model"]["aliases"])
    keys = [k for k in keys if k not in frozen and aliases.get(k) not in frozen]
    missing = [k for k in keys if k not in out]
    if missing:
        raise ValueError(f"checkpoint {saved.folder!r} lacks {missing[:3]} of the model's state_dict")
    return {k: out[k] for k in keys}


def export_hf(directory: str, out: str, *, tag: str | None = None, dtype: torch.dtype | None = None,
              max_shard_size: int | str = "5GB", config=None, overwrite: bool = False) -> str:
    """Write checkpoint ``directory/tag`` (saved at any world size, by any composition) as a Hugging Face
    model folder ``out``, one unit in memory at a time, in this process alone; returns ``out``. The
    rest as ``save_hf`` (hf_export), ``overwrite`` too."""
    return export_saved(Saved(resolve(directory, tag)), out, dtype=dtype, max_shard_size=max_shard_size,
                        config=config, overwrite=overwrite)
