"""torch's CPU allocator replaced by one that keeps large blocks for reuse (csrc/alloc/large_blocks.cpp).

``install()`` makes it the allocator of every later CPU tensor of at least
``MIN_BYTES`` (smaller ones still go to the allocator torch had), once per
process. A freed large block is kept for the next request of its size, and
the cache never lets the process hold more than its peak of live large
blocks, so a training step, which asks for the same sizes every step, runs
without page faults after its first and without the heap fragmentation that
glibc's malloc leaves behind per-unit temporaries. ``ZFUNC_CPU_ALLOCATOR=0``
(or ``ZFUNC_OPS_DISABLE=large_blocks``) keeps torch's allocator.
"""
from __future__ import annotations

import os

from . import builder

NAME = "large_blocks"
SOURCES = ["alloc/large_blocks.cpp"]
MIN_BYTES = 1 << 20  # below this, malloc's heap serves well and mapping costs more than it saves


def load():
    return builder.load(NAME, SOURCES)


def wanted() -> bool:
    return os.environ.get("ZFUNC_CPU_ALLOCATOR", "1").strip().lower() not in ("0", "false", "no", "off")


def install() -> bool:
    """Make it torch's CPU allocator (idempotent). True if it is in place after the call."""
    global _installed
    if not _installed and wanted():
        module = load()
        if module is not None:
            module.install(MIN_BYTES)
            _installed = True
    return _installed


def installed() -> bool:
    return _installed


def stats() -> dict[str, int]:
    """``live_bytes``, ``cached_bytes``, ``peak_live_bytes``, ``hits``, ``misses`` ({} if not installed)."""
    return dict(load().stats()) if _installed else {}


def empty_cache() -> None:
    """Give every cached block back to the OS."""
    if _installed:
        load().empty_cache()


_installed = False
