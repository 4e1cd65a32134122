"""``zf.recompute``: each unit's activations recomputed in backward, so a step holds only the unit
boundaries from forward to backward (activation checkpointing, done by the step).

Under offload the parameters and optimizer state leave the device and the activations are what
bounds a micro-batch; recomputing each block (one more forward of it in backward) lets the
micro-batch grow by about the ratio of a block's activations to its input. The step wraps each
unit's module in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while its forward
runs (zfunc.recompute_units), so the step equals plain PyTorch with that checkpoint around the same
blocks. It changes neither the state's layout nor the arithmetic: it composes with every stage,
precision, accumulation, clipping and offload, anywhere in the composition, and a state works with
or without it.
"""
from __future__ import annotations

from ..recompute_units import Policy
from ..step import Step, expect_step
from ..transform import Transform


class Recompute(Transform):
    family = "recompute"
    shapes_state = False  # the same state with or without it

    def __init__(self, policy: Policy):
        self.policy = policy

    @property
    def recompute(self) -> Policy:
        return self.policy

    def describe(self, inner: str) -> str:
        chosen = self.policy.describe()
        return f"recompute({inner}{', ' + chosen if chosen else ''})"


def recompute(step: Step, units=None) -> Step:
    """``step`` with each unit's module run under non-reentrant activation checkpointing: backward
    runs the unit's forward again instead of keeping its activations (module docstring).

    ``units``: which units (default every one but the root; a unit nested in a chosen one goes
    with it): a list of unit names (``"blocks.0"``) or a predicate ``(name, module) -> bool``,
    e.g. every other block. Anywhere in the composition, once:
    ``zf.zero3(zf.offload_cpu(zf.recompute(zf.train_step(loss_fn, opt))))``.
    """
    expect_step(step, "recompute")
    return step.then(Recompute(Policy(units)))
