"""The swap folder of one state, ``path/rank{r}/state-XXXXXX/``, and the folders above it.

A store makes its state's folder fresh, with whatever parents are missing; each parent it made
gets a mark (``.zfunc-made``), so that whichever rank closes last removes them, and the path is
left as it was, whichever rank made its folders. A folder the user made is never removed.
"""
from __future__ import annotations

import os
import tempfile

_MADE = ".zfunc-made"  # in each folder above a state's that a store made: whichever rank closes last removes it


def fresh_folder(rank_dir: str) -> str:
    """A new ``state-XXXXXX`` folder under ``rank_dir``, made with its parents, each parent it
    made marked; tried again if another rank's store removed an empty parent in between."""
    for attempt in range(3):
        try:
            make_marked(rank_dir)
            return tempfile.mkdtemp(prefix="state-", dir=rank_dir)
        except FileNotFoundError:
            if attempt == 2:
                raise


def make_marked(path: str) -> None:
    """``path`` made with whatever parents are missing, each folder made marked, so that
    ``remove_made`` takes them away again once they are empty."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path!r} is a file, not a folder: give a folder for the swap files")
    made = _missing_folders(path)
    os.makedirs(path, exist_ok=True)
    for folder in made:
        open(os.path.join(folder, _MADE), "a").close()


def _missing_folders(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    out = []
    while path and not os.path.exists(path):
        out.append(path)
        parent = os.path.dirname(path)
        path = "" if parent == path else parent
    return out


def remove_made(folder: str) -> None:
    """Remove ``folder`` and the folders above it while each holds nothing but the mark a store
    left when it made it: one another state or rank still uses stays, and so does every folder the
    user made. Any rank may remove what another made (the last to close does), so the path is
    left as it was whichever rank made its folders."""
    while True:
        try:
            if os.listdir(folder) != [_MADE]:
                return
            os.remove(os.path.join(folder, _MADE))
            os.rmdir(folder)
        except OSError:  # another rank removed it first, or put something in: left to it
            if os.path.exists(folder):
                return
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent
