"""Checkpoints: each rank writes its own shards, rank 0 a manifest; load at any world size.

A checkpoint is a folder ``DIR/TAG/``::

    manifest.json     rank 0: the model's layout (units, parameter names and shapes),
                      each Params node's flat layout per unit (elements, padded
                      length, sharded or whole), the world size, the composition,
                      the step count and whatever the caller adds (config, engine
                      counters)
    rank{r}.bin       rank r's bytes: its shard of every sharded unit (parameters,
                      master weights, moments); rank 0 also the whole-buffer units
                      and the other tensors (step counters, loss scale, buffers)
    rank{r}.json      the index of rank{r}.bin, and rank r's RNG state

Every tensor goes in as raw bytes, one unit at a time, so a state whose tensors
live in swap files (``offload_nvme``) is written without ever being whole in RAM.
The folder is written under a temporary name and renamed once every rank's files
and the manifest are complete; ``DIR/latest`` names the newest tag and is
replaced last. A save killed at any point leaves the previous checkpoint, and
``latest``, as they were. Free space is checked on every rank before writing.

Loading rebuilds each unit's flat buffer from the saved shards (any saved world
size), pads it for the current one and keeps this rank's shard, one unit at a
time: resharding is a by-product of storing flat layouts (``load``).
``python -m zfunc.checkpoint consolidate DIR OUT.pt`` writes one fp32
``state_dict`` that ``model.load_state_dict`` accepts.
"""
from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import sys
from typing import Any

import optree
import torch

from . import dist, swap
from .ops import aio
from .pytree import NAMESPACE, tree_unflatten
from .tree import ModelSpec, Params

FORMAT = 1
SLACK = 1.05  # free space wanted, relative to the bytes a save writes
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool)}


# ------------------------------------------------------------------ the state's parts


def _parts(state) -> tuple[list[str], list[Any], Any]:
    """``(paths, nodes, treedef)``: every ``Params`` node and every other leaf of ``state``,
    each named by its path (``opt_state.inner.mu``, ``buffers['bn.running_mean']``)."""
    accessors, nodes, treedef = optree.tree_flatten_with_accessor(state, is_leaf=lambda x: isinstance(x, Params),
                                                                  namespace=NAMESPACE)
    return [a.codify("").lstrip(".") for a in accessors], nodes, treedef


def _is_whole(t: torch.Tensor, sharded: bool) -> bool:
    """A leaf every rank holds the same of: a whole buffer, or a per-unit counter (0-d)."""
    return not sharded or t.dim() == 0


def _settle(state) -> None:
    """Wait for writes behind the last step (offload_nvme), so the files hold the latest values."""
    store = swap.open_store(state)
    if store is not None:
        store.settle()


def model_layout(spec: ModelSpec) -> dict:
    """The model's layout as plain data: what a checkpoint must match to load."""

    def segment(s):
        return {"numel": s.numel, "dtype": str(s.dtype),
                "entries": [[e.name, list(e.shape)] for e in s.entries]}

    return {"units": [{"name": u.name, "trainable": segment(u.trainable), "frozen": segment(u.frozen)}
                      for u in spec.units],
            "aliases": [list(a) for a in spec.canonical]}


def _first_difference(saved: dict, ours: dict) -> str | None:
    """The first parameter whose name or shape differs between two model layouts, in words."""
    def params(lay):
        return [(n, tuple(s)) for u in lay["units"] for kind in ("trainable", "frozen") for n, s in u[kind]["entries"]]

    a, b = params(saved), params(ours)
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            if x is None:
                return f"parameter {y[0]!r} {y[1]} is in this model but not in the checkpoint"
            if y is None:
                return f"parameter {x[0]!r} {x[1]} is in the checkpoint but not in this model"
            if x[0] != y[0]:
                return f"parameter {i}: {x[0]!r} {x[1]} in the checkpoint, {y[0]!r} {y[1]} in this model"
            return f"parameter {x[0]!r} has shape {x[1]} in the checkpoint but {y[1]} in this model"
    if saved != ours:
        return "the same parameters, grouped into other units (another unit policy)"
    return None


# ------------------------------------------------------------------------- saving


class _Writer:
    """Appends tensors' raw bytes to one file through zfunc's asynchronous file I/O (direct
    writes where the file system allows, several in flight) and indexes them."""

    def __init__(self, path: str):
        self.path = path
        open(path, "wb").close()
        self.io = aio.AsyncIO(block_size=1 << 22, queue_depth=8, check_space=False)  # checked once, up front
        self.index: list[dict] = []
        self.offset = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if data.numel():
            _write_chunk(self.io, data, self.path, self.offset)
        self.index.append({"key": key, "dtype": str(t.dtype), "shape": list(t.shape), "offset": self.offset})
        self.offset += data.numel()

    def close(self, extra: dict) -> None:
        self.io.close()  # every write done (or its error raised)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _write_json(self.path[: -len(".bin")] + ".json", {"tensors": self.index, **extra})


def _write_chunk(io, data: torch.Tensor, path: str, offset: int) -> None:
    io.pwrite(data, path, offset)


def _write_text(path: str, text: str) -> None:
    """Write ``path`` atomically: a temporary file, fsync, rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: str, obj) -> None:
    _write_text(path, json.dumps(obj))


def _bytes_to_write(paths, nodes, rank: int) -> int:
    total = 0
    for node in nodes:
        if isinstance(node, Params):
            for t, sharded in zip(node.leaves, node.spec.sharded):
                if t is not None and (rank == 0 or not _is_whole(t, sharded)):
                    total += t.numel() * t.element_size()
        elif isinstance(node, torch.Tensor) and rank == 0:
            total += node.numel() * node.element_size()
    return total


def _check_space(folder: str, need: int, group) -> None:
    """Raise on every rank if any rank lacks room: no rank starts writing a save that cannot finish."""
    free = shutil.disk_usage(folder).free
    short = torch.tensor([float(need * SLACK > free)], dtype=torch.float64, device=dist.device_of(group))
    dist.all_reduce_sum(short, group)
    if short.item():
        raise OSError(28, f"not enough free space for a checkpoint in {folder!r}: this rank writes {need} bytes "
                          f"and {free} are free (a rank of the group is short); nothing was written, the previous "
                          "checkpoint is intact")


def save(state, directory: str, tag: str, *, extra: dict | None = None, group=None) -> str:
    """Write ``state`` as checkpoint ``directory/tag`` (every rank calls it); return its folder.

    ``extra``: plain data for the manifest (the engine's counters, its config).
    """
    r, w = dist.rank(group), dist.world_size(group)
    if not tag or os.sep in tag or tag.startswith(".") or tag == "latest":
        raise ValueError(f"a checkpoint tag is a plain folder name, got {tag!r}")
    os.makedirs(directory, exist_ok=True)
    _settle(state)
    paths, nodes, _ = _parts(state)
    _check_space(directory, _bytes_to_write(paths, nodes, r), group)
    staging = os.path.join(directory, f".{tag}.partial")
    if r == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a save killed before left it
        os.makedirs(staging)
    dist.barrier(group)
    writer = _Writer(os.path.join(staging, f"rank{r}.bin"))
    layouts = {}
    for path, node in zip(paths, nodes):
        if isinstance(node, Params):
            units = []
            for i, (t, sharded) in enumerate(zip(node.leaves, node.spec.sharded)):
                seg = node.spec.segment(i)
                if t is None:
                    units.append(None)
                    continue
                whole = _is_whole(t, sharded)
                units.append({"numel": seg.numel if t.dim() else 0, "sharded": not whole, "dtype": str(t.dtype)})
                if r == 0 or not whole:
                    writer.add(f"{path}#{i}", swap.load(t))  # one unit in RAM at a time
            layouts[path] = units
        elif isinstance(node, torch.Tensor):
            if r == 0:
                writer.add(path, node)
            layouts[path] = "tensor"
        else:
            layouts[path] = {"value": node}
    rng = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state().tolist()
    writer.close({"rank": r, "rng": rng})
    dist.barrier(group)  # every rank's files are complete
    folder = os.path.join(directory, tag)
    if r == 0:
        spec = state.params.spec.model
        manifest = {"format": FORMAT, "world": w, "composition": None if state.plan is None else state.plan.composition,
                    "count": int(state.count), "model": model_layout(spec), "layouts": layouts, **(extra or {})}
        _write_json(os.path.join(staging, "manifest.json"), manifest)
        old = os.path.join(directory, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(folder):
            os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old, ignore_errors=True)
        _write_text(os.path.join(directory, "latest"), tag)
    dist.barrier(group)
    return folder


# ------------------------------------------------------------------------ loading


def resolve(directory: str, tag: str | None = None) -> str:
    """The folder of checkpoint ``tag`` (default: the one ``latest`` names), checked complete."""
    if tag is None:
        latest = os.path.join(directory, "latest")
        if not os.path.exists(latest):
            raise FileNotFoundError(f"no checkpoint in {directory!r}: it has no 'latest' file; pass tag= to name one")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(directory, tag)
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        raise FileNotFoundError(f"checkpoint {folder!r} is missing or incomplete (no manifest.json)")
    return folder


class Saved:
    """A checkpoint's manifest and its ranks' tensors, read lazily (memory-mapped)."""

    def __init__(self, folder: str):
        self.folder = folder
        with open(os.path.join(folder, "manifest.json")) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{folder!r}: checkpoint format {self.manifest.get('format')}, this zfunc reads {FORMAT}")
        self.world = self.manifest["world"]
        self.ranks = []
        for k in range(self.world):
            with open(os.path.join(folder, f"rank{k}.json")) as f:
                meta = json.load(f)
            with open(os.path.join(folder, f"rank{k}.bin"), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # copy-on-write: writable for torch.frombuffer, never written back to the file
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            self.ranks.append((mm, {e["key"]: e for e in meta["tensors"]}, meta))

    def view(self, rank: int, key: str) -> torch.Tensor:
        """Tensor ``key`` of rank ``rank``'s file, as a view of the mapped file (copy what you keep)."""
        mm, index, _ = self.ranks[rank]
        e = index[key]
        dtype = _DTYPES[e["dtype"]]
        n = math.prod(e["shape"])
        if not n:
            return torch.empty(e["shape"], dtype=dtype)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=n * dtype.itemsize, offset=e["offset"])
        return raw.view(dtype).reshape(e["shape"])

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        return self.view(rank, key).clone()

    def read_into(self, path: str, i: int, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Elements ``[start, start + len(out))`` of unit ``i``'s unpadded flat buffer in the Params node
        at ``path`` (any saved world size; zeros past its end) into ``out``: only the saved shards that
        overlap are read, so a load at the saved world size reads just this rank's file."""
        lay = self.manifest["layouts"][path][i]
        key = f"{path}#{i}"
        if out.dim() == 0:
            return out.copy_(self.view(0, key).reshape(()))
        stop = min(start + out.numel(), lay["numel"])
        if not lay["sharded"]:
            if stop > start:
                out[: stop - start].copy_(self.view(0, key)[start:stop])
        else:
            shard = self.view(0, key).numel()
            pos = start
            while pos < stop:
                k, offset = divmod(pos, shard)
                take = min(shard - offset, stop - pos)
                out[pos - start: pos - start + take].copy_(self.view(k, key)[offset: offset + take])
                pos += take
        out[max(stop - start, 0):].zero_()  # padding
        return out

    def unit(self, path: str, i: int) -> torch.Tensor:
        """Unit ``i`` of the Params node at ``path``: its whole unpadded flat buffer (or 0-d counter)."""
        lay = self.manifest["layouts"][path][i]
        e = self.ranks[0][1][f"{path}#{i}"]
        return self.read_into(path, i, torch.empty(lay["numel"] if e["shape"] else (), dtype=_DTYPES[e["dtype"]]))

    def rng(self, rank: int) -> dict:
        return self.ranks[rank if rank < self.world else 0][2]["rng"]


def load(state, directory: str, tag: str | None = None, *, group=None, sources=None):
    """Copy checkpoint ``directory/tag`` into ``state`` (built by the step that will use it, at any
    world size); returns ``(state, manifest)``. Every rank calls it.

    ``sources``: ``(primary, locate)`` for a state whose units were saved in several
    checkpoints (pipeline stages cut elsewhere): ``locate(unit) -> (Saved, its unit there)``;
    ``primary`` (a ``Saved``) gives everything that is not per unit (step counters, buffers)."""
    spec = state.params.spec.model
    if sources is None:
        saved = Saved(resolve(directory, tag))
        difference = _first_difference(saved.manifest["model"], model_layout(spec))
        if difference is not None:
            raise ValueError(f"checkpoint {saved.folder!r} was saved from another model: {difference}")

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
    paths, nodes, treedef = _parts(state)
    if list(manifest["layouts"]) != paths:
        raise ValueError(
            f"checkpoint {saved.folder!r} holds the state of {manifest.get('composition')}, but this step's state is "
            f"{None if state.plan is None else state.plan.composition}; their parts differ. Load it into a state "
            "built by the same composition of transforms (any world size)")
    store = swap.open_store(state)
    if store is not None:
        store.drop_resident()  # the files are about to change under it
    out = []
    for path, node in zip(paths, nodes):
        if isinstance(node, Params):
            group_of_node = node.spec.process_group
            r = dist.rank(group_of_node)
            for i, (leaf, sharded) in enumerate(zip(node.leaves, node.spec.sharded)):
                if leaf is None or (leaf.dim() and not leaf.numel()):
                    continue
                # this rank's part of the unit laid out for this world size: its shard, or all of it
                start = r * leaf.numel() if not _is_whole(leaf, sharded) else 0
                src, j = locate(i)
                if swap.on_disk(leaf):
                    value = src.read_into(path, j, torch.empty(leaf.shape, dtype=leaf.dtype), start)
                    store_of_leaf, _, _ = swap.locate(leaf)
                    store_of_leaf.write_now(value, leaf)
                else:
                    src.read_into(path, j, leaf, start)
            out.append(node)
        elif isinstance(node, torch.Tensor):
            node.copy_(saved.view(0, path))
            out.append(node)
        else:
            out.append(manifest["layouts"][path]["value"])
    rng = saved.rng(dist.rank(group))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(rng["cuda"], dtype=torch.uint8))
    dist.barrier(group)
    return tree_unflatten(treedef, out), manifest


# -------------------------------------------------------------------- consolidate


def _master_path(layouts: dict) -> str:
    """The Params node with the full-precision trainable weights: the fp32 master under mixed
    precision, else the parameters."""
    masters = [p for p in layouts if p.rsplit(".", 1)[-1] == "master" and isinstance(layouts[p], list)]
    return masters[0] if masters else "params"


def consolidate(directory: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """One fp32 ``state_dict`` (parameters, tied names too, and buffers) from a checkpoint."""
    saved = Saved(resolve(directory, tag))
    manifest = saved.manifest
    units = manifest["model"]["units"]
    out: dict[str, torch.Tensor] = {}
    for path, kind in ((_master_path(manifest["layouts"]), "trainable"), ("frozen", "frozen")):
        for i, unit in enumerate(units):
            entries = unit[kind]["entries"]
            if not entries:
                continue
            flat = saved.unit(path, i).float()
            offset = 0
            for name, shape in entries:
                n = math.prod(shape)
                out[name] = flat[offset: offset + n].reshape(shape).clone()
                offset += n
    for alias, canonical in manifest["model"]["aliases"]:
        out[alias] = out[canonical]
    for path, lay in manifest["layouts"].items():
        if path.startswith("buffers['") and lay == "tensor":
            out[path[len("buffers['"): -len("']")]] = saved.tensor(0, path)
    keys = manifest.get("state_dict_keys")
    if keys is None:
        return out
    missing = [k for k in keys if k not in out]
    if missing:
        raise ValueError(f"checkpoint {saved.folder!r} lacks {missing[:3]} of the model's state_dict")
    return {k: out[k] for k in keys}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zfunc.checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one fp32 state_dict from a sharded checkpoint")
    c.add_argument("directory")
    c.add_argument("out")
    c.add_argument("--tag", default=None, help="default: the checkpoint 'latest' names")
    c.add_argument("--safetensors", action="store_true", help="write a .safetensors file (needs safetensors)")
    args = parser.parse_args(argv)
    state_dict = consolidate(args.directory, args.tag)
    if args.safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            parser.error("--safetensors needs the safetensors package: pip install safetensors")
        unique = {}
        seen = {}
        for k, v in state_dict.items():  # safetensors refuses shared storage: tied names get their own copy
            unique[k] = v.clone() if id(v) in seen else v
            seen[id(v)] = k
        save_file({k: v.contiguous() for k, v in unique.items()}, args.out)
    else:
        torch.save(state_dict, args.out)
    n = sum(v.numel() for k, v in state_dict.items())
    print(f"wrote {args.out}: {len(state_dict)} tensors, {n} elements", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
