"""A checkpoint's ``client_state``: what the caller saves beside the training state and gets back
from ``load_checkpoint``, as DeepSpeed's engine keeps it.

Plain data (JSON) stays in the manifest, readable by ``python -m zfunc.checkpoint``. Anything else
torch can pickle (Lightning's callback states hold tensors: ``ModelCheckpoint``'s best score) goes to
``client_state.pt`` in the checkpoint's folder, written by the manifest's writer before the folder is
published, and is read back with ``torch.load(weights_only=False)``, as DeepSpeed reads its own
checkpoint: load only checkpoints you trust.
"""
from __future__ import annotations

import io
import json
import os

import torch

FILE = "client_state.pt"


def pack(client_state) -> tuple[dict, dict]:
    """``(manifest entries, files)`` for ``client_state``: files maps a name in the checkpoint's folder
    to its bytes (``checkpoint.save``'s ``files``), pickled here, on every rank, so that what cannot be
    pickled raises before any rank writes."""
    if client_state is None:
        return {"client_state": {}}, {}
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
    try:
        json.dumps(client_state)
        return {"client_state": client_state}, {}
    except (TypeError, ValueError):
        pass
    buffer = io.BytesIO()
    try:
        torch.save(client_state, buffer)
    except Exception as e:
        raise TypeError(f"client_state could not be saved: {type(e).__name__}: {e}. Give plain data, tensors or "
                        "objects torch.save can pickle") from e
    return {"client_state_file": FILE}, {FILE: buffer.getvalue()}


def unpack(folder: str, manifest: dict) -> dict:
    """The ``client_state`` a checkpoint (its ``folder`` and ``manifest``) was saved with."""
    name = manifest.get("client_state_file")
    if name is None:
        return manifest.get("client_state", {})
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {folder!r} names its client state {name!r}, which is missing: the "
                                "folder is incomplete; load another checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)
