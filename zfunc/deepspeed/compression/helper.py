"""``deepspeed.compression.helper``: reaching a submodule by its dotted name."""
from __future__ import annotations

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``module_name`` ``"a.b.c"``."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model, module_name: str, module) -> None:
    """Set ``model.a.b.c = module`` for ``module_name`` ``"a.b.c"``."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)
