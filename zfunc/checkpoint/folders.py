"""Where a checkpoint's files go, so that a save killed at any instant leaves one that loads.

A save writes every file into the staging folder ``DIR/.TAG.partial``, fsyncs
them, writes the manifest last, then (rank 0):

1. renames the staging folder to a name no folder has (``TAG``, or ``TAG.r1``,
   ``TAG.r2``, ... when ``TAG`` is taken: a save that reuses a tag) and fsyncs ``DIR``;
2. replaces ``DIR/latest`` (the folder's name) atomically: temporary file, fsync,
   ``os.replace``, fsync ``DIR``;
3. only then removes the folders the save supersedes (the tag's older ones): each
   is renamed to ``DIR/.trash-...`` first, so no half-removed folder keeps its name.

A folder under a final name is therefore always complete, ``latest`` always names
one, and a tag resolves to its newest complete folder (the manifest records the
tag and the time of the save). Killed before step 1, the previous checkpoint is
the one that loads; after it, the new one (by its tag; by ``latest`` after step 2).
Leftovers (a staging folder, trash) are removed by the next save.
"""
from __future__ import annotations

import os
import re
import shutil

from .files import fsync_dir, read_json, write_text

LATEST = "latest"
MANIFEST = "manifest.json"


def check_tag(tag: str) -> None:
    if not tag or os.sep in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"a checkpoint tag is a plain folder name, not starting with '.', got {tag!r}")


def staging(directory: str, tag: str) -> str:
    return os.path.join(directory, f".{tag}.partial")


def prepare(directory: str, tag: str) -> str:
    """Rank 0, before any rank writes: remove what killed saves left; an empty staging folder."""
    for entry in os.listdir(directory):
        if entry.startswith(".trash-"):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
        elif entry.startswith(LATEST + ".tmp-"):
            os.remove(os.path.join(directory, entry))
    folder = staging(directory, tag)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


def free_name(directory: str, tag: str) -> int:
    """``k`` such that ``name(tag, k)`` is free in ``directory``."""
    k = 0
    while os.path.exists(os.path.join(directory, name(tag, k))):
        k += 1
    return k


def name(tag: str, k: int) -> str:
    return tag if k == 0 else f"{tag}.r{k}"


def publish(directory: str, tag: str, final: str) -> None:
    """Rank 0, once the staging folder is complete: steps 1-3 of the module docstring."""
    superseded = folders_of(directory, tag)
    fsync_dir(staging(directory, tag))
    os.rename(staging(directory, tag), os.path.join(directory, final))
    fsync_dir(directory)
    write_text(os.path.join(directory, LATEST), final)
    for old in superseded:
        trash = os.path.join(directory, f".trash-{os.path.basename(old)}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(old, trash)
        fsync_dir(directory)
        shutil.rmtree(trash)


def folders_of(directory: str, tag: str) -> list[str]:
    """The complete folders of checkpoint ``tag``, oldest first."""
    pattern = re.compile(re.escape(tag) + r"(\.r\d+)?")
    found = []
    for entry in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        folder = os.path.join(directory, entry)
        if pattern.fullmatch(entry) and os.path.exists(os.path.join(folder, MANIFEST)):
            manifest = read_json(os.path.join(folder, MANIFEST))
            if manifest.get("tag", entry) == tag:
                found.append((manifest.get("saved_ns", 0), folder))
    return [folder for _, folder in sorted(found)]


def resolve(directory: str, tag: str | None = None) -> str:
    """The folder of checkpoint ``tag`` (its newest complete one), or the one ``latest`` names."""
    if tag is None:
        latest = os.path.join(directory, LATEST)
        if not os.path.exists(latest):
            raise FileNotFoundError(f"no checkpoint in {directory!r}: it has no 'latest' file; pass tag= to name one")
        with open(latest) as f:
            folder = os.path.join(directory, f.read().strip())
        if not os.path.exists(os.path.join(folder, MANIFEST)):
            raise FileNotFoundError(f"checkpoint {folder!r}, which {latest!r} names, is missing or incomplete (no "
                                    f"{MANIFEST}); pass tag= to load another")
        return folder
    found = folders_of(directory, tag)
    if not found:
        raise FileNotFoundError(f"checkpoint {os.path.join(directory, tag)!r} is missing or incomplete (no "
                                f"{MANIFEST})")
    return found[-1]
