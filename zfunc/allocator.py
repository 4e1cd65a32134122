"""Give freed large buffers back to the OS promptly (glibc's malloc)."""
from __future__ import annotations

import ctypes
import os
import sys

_M_MMAP_THRESHOLD = -3
_done = False


def configure() -> None:
    """Serve allocations of 64 KiB and more by mmap, so freeing returns them (idempotent)."""
    global _done
    if _done or not sys.platform.startswith("linux") or os.environ.get("ZFUNC_MALLOC") == "default":
        return
    _done = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 65536)
    except (OSError, AttributeError):
        pass
