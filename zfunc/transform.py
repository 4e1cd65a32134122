"""What a step transform is: a recorded contribution to placement, gradient and update.

A transform takes a step and returns a step (``Step.then``). It contributes

* ``place``: a pure function on one unit's ``Placement`` record (given the unit);
* ``wrap_optimizer``: the update part, an ``(init, update)`` pair over the
  state's ``Params`` (zero1/2/3 update only this rank's slice, then gather);
* ``wrap_grad``: the gradient part, ``(params, batch, **kw) -> GradOut``
  (accumulation wraps here).

A transform whose ``shapes_state`` is False (accumulation) leaves the state's
layout alone: it is not part of ``Plan``, so its state works with steps with or
without it (another number of micro-batches, an eval step).

Transforms are recorded outermost first; placements and wrappers are folded
innermost first, so ``zero3(offload_nvme(f))`` means offload, then sharding.
``check`` enforces the composition rules below when a transform is applied
to a step that already carries ``inner`` transforms.

| transform | may appear | rule |
| --- | --- | --- |
| ``zero1``/``zero2``/``zero3`` | once (one stage) | outside precision and accumulation (and offload) |
| ``mixed_precision`` | once | inside the ZeRO stage and offload: ``zero3(offload_cpu(mixed_precision(f)))`` |
| ``offload_cpu``/``offload_nvme`` | once (one of them) | inside the ZeRO stage, outside ``mixed_precision`` (it offloads what is inside it); NVMe parameters not under zero1/2 |
| ``accumulate`` | once | inside the ZeRO stage; either side of ``mixed_precision`` |
| ``units`` | once, or agreeing with ``zero3(units=...)`` / ``train_step(units=...)`` | anywhere |
"""
from __future__ import annotations

import torch

from .placement import Placement


class Transform:
    """Base: contributes nothing; subclasses override what they change.

    Besides the three contributions above, the step asks its transforms (outermost
    first) for what it must not know by name: the settings below (the first
    transform that gives one wins) and the hooks after ``wrap_grad``, each a no-op
    here."""

    family = "transform"  # transforms of one family exclude each other (``check``)
    shapes_state = True  # part of the state's Plan
    prefetch = None  # the coordinator's settings (zfunc.coordinator.Prefetch)
    group = None  # the process group the step runs over (None: the world)
    replicate = None  # hybrid sharding: the process group the state is replicated over (zero's mesh=)
    unit_policy = None  # the unit policy (zf.units)
    loss_scaler = None  # fp16's LossScaler: the step scales the loss and may skip
    accumulates = False  # the gradient part sums micro-batches (in fp32)
    recompute = None  # the units whose activations backward recomputes (zf.recompute: zfunc.recompute_units.Policy)

    def describe(self, inner: str) -> str:
        return f"{self.name}({inner})"

    def params_off_device_error(self, stage: int) -> str | None:
        """Why zero1/zero2 (``stage``), which keep the full parameters on every rank's device,
        cannot keep them where this transform puts them, and what to write; None if they can."""
        return None

    @property
    def name(self) -> str:
        return type(self).__name__.lower()

    def check(self, inner: tuple["Transform", ...]) -> None:
        for t in inner:
            if t.family == self.family:
                raise ValueError(f"{t.describe('step')} is already applied; apply {self.family} transforms once")

    def place(self, p: Placement, unit) -> Placement:
        return p

    def place_in(self, p: Placement, unit, spec, step) -> Placement:
        """``place`` for a transform whose choice for one unit depends on the others (``spec``,
        the whole model's) or on the step: offload_cpu's plan of units kept on the device."""
        return self.place(p, unit)

    def wrap_optimizer(self, optimizer):
        return optimizer

    def wrap_grad(self, grad_fn):
        return grad_fn

    # ------------------------------------------------ hooks the step calls

    def init_home(self, step, spec, places, group):
        """At ``Step.init``, before any unit is made: an object that takes each unit's leaves as
        they are made, ``keep(i, unit, place, leaf, frozen) -> leaf``, whose ``key`` the state's
        ``ParamsSpec.swap`` records, whose ``finish()`` runs after the optimizer's init and whose
        ``close()`` removes what it made if the init raises (it closes what it made itself if
        it raises before returning); or None (the default): the leaves stay where they are made."""
        return None

    def cast_buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Buffer ``name`` as the state keeps it (mixed precision casts)."""
        return t

    def micro_batches(self, batch) -> list | None:
        """The micro-batches one step takes ``batch`` as; None (the default): one, itself."""
        return None

    def check_state(self, state) -> None:
        """Raise if ``state`` cannot be used by a step (offload_nvme: its files were closed)."""

    def begin_step(self, state):
        """At a step's start: what ``step_metrics`` compares against at its end."""
        return None

    def step_metrics(self, state, begun) -> dict:
        """Metrics of an applied update, given what ``begin_step`` returned."""
        return {}

    def grad_stats(self, g: torch.Tensor) -> tuple[float, bool] | None:
        """``(sum of squares, all finite)`` of gradient ``g`` if this transform measured it
        (offload_nvme: a gradient on disk, measured as it was written); None: read ``g``."""
        return None

    def sum_home(self, spec):
        """For a transform that keeps gradients off the device: a new home (one step's) of the fp32
        sums of gradients of ``spec`` between micro-batches, a ``zfunc.transforms.sinks.SumHome``
        (offload_cpu: host memory; offload_nvme: the gradient files); None (the default): device
        memory."""
        return None

    def grad_part(self, loss_fn, has_aux: bool):
        """A gradient part that replaces the eager one (``(params, batch, **kw) -> GradOut``, as
        zfunc.grad's ``value_and_grad_with_stats``; zf.jit's traced program), or None (the default)."""
        return None

    def move(self, leaf: torch.Tensor, to: str, device: torch.device | None = None) -> torch.Tensor:
        """A unit's stored leaf moved to home ``to`` (``placement.DEVICE``, ``CPU`` or ``NVME``;
        ``device``: the accelerator for ``DEVICE``), for a transform that keeps leaves off the
        device (offload_cpu: pinned host copies; offload_nvme: swap files). The default keeps
        nothing elsewhere: the leaf as it is."""
        return leaf


def check_inside_zero(transform: Transform, inner, example: str) -> None:
    """Raise if ``transform`` is applied outside a ZeRO stage (``example`` shows the right order)."""
    Transform.check(transform, inner)
    for t in inner:
        if t.family == "zero":
            raise ValueError(
                f"{transform.name} must go inside the ZeRO stage, which shards what it makes: write "
                f"{example.replace('zeroN', t.name)}, not {transform.name}({t.name}(...))"
            )


class Units(Transform):
    """Sets the unit policy (see ``zf.units``)."""

    family = "units"

    def __init__(self, policy):
        self.policy = policy

    @property
    def unit_policy(self):
        return self.policy

    @property
    def name(self) -> str:
        return "units"

    def describe(self, inner: str) -> str:
        return f"units({inner}, {_policy_text(self.policy)})"

    def check(self, inner) -> None:
        for t in inner:
            if t.family == "units":
                raise ValueError(
                    f"this step already has units {_policy_text(t.policy)}; give the unit policy once "
                    f"(zf.units, zero3(units=...) or train_step(units=...)), not also {_policy_text(self.policy)}"
                )


def _policy_text(policy) -> str:
    if callable(policy):
        return getattr(policy, "__name__", "predicate")
    return repr(list(policy))
