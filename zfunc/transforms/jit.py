"""``zf.jit``: a step whose forward and backward are one compiled program (zfunc.traced)."""
from __future__ import annotations

from ..step import Step, expect_step
from ..traced import Jit


def jit(step: Step, *, regather: bool = False, **compile_kwargs) -> Step:
    """``step`` with its forward and backward compiled as one program (zfunc.traced);
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ...).
    Anywhere in the composition: ``zf.jit(zf.zero3(zf.mixed_precision(f, torch.bfloat16)))``.

    ``regather``: gather each unit again in backward instead of keeping it from forward (ZeRO-3's
    memory; one more all-gather per unit), through selective activation checkpointing, which
    under torch.compile asks that the model run no in-place op on a saved tensor."""
    expect_step(step, "jit")
    return step.then(Jit(dict(compile_kwargs), regather))
