"""The "unknown name, did you mean ..." message every config reader gives.

It lives in ``zfunc.ops`` because ops is the bottom layer: it imports nothing
of zfunc, and every other part of zfunc (the config parser, the lr schedules,
the unit policy) may import it, while ops' own readers (``aio``) may not reach
above themselves.
"""
from __future__ import annotations

import difflib
from typing import Sequence


def nearest(name, candidates: Sequence[str], *, cutoff: float = 0.6) -> str | None:
    """The candidate closest to ``name``, or None when none is close enough."""
    near = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=cutoff)
    return near[0] if near else None


def unknown(what: str, name, valid: Sequence[str], *, label: str = "valid",
            candidates: Sequence[str] | None = None, sep: str = ": ", cutoff: float = 0.6) -> str:
    """``unknown <what>``, a hint at the nearest of ``candidates`` (default: ``valid``)
    to ``name`` and the list of ``valid`` names, under ``label``."""
    near = nearest(name, valid if candidates is None else candidates, cutoff=cutoff)
    hint = f"{sep}did you mean {near!r}?" if near else ""
    return f"unknown {what}{hint} ({label}: {', '.join(valid)})"
