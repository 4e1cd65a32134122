"""``zf.jit``: a step whose forward and backward are one compiled program (zfunc.traced)."""
from __future__ import annotations

from ..step import Step, expect_step
from ..traced import Jit


def jit(step: Step, **compile_kwargs) -> Step:
    """``step`` with its forward and backward compiled as one program (module docstring);
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ...).
    Anywhere in the composition: ``zf.jit(zf.zero3(zf.mixed_precision(f, torch.bfloat16)))``."""
    expect_step(step, "jit")
    return step.then(Jit(dict(compile_kwargs)))
