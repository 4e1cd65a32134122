"""Steps: ``(state, batch) -> (state, metrics)``, in three parts that transforms wrap.

A ``Step`` is a loss function, an optimizer and the transforms applied to it,
recorded outermost first. Its three parts:

* ``init(model) -> State``: one placement record per unit (the transforms'
  ``place`` functions folded over a default record), then each rank's shards,
  unit by unit (zfunc.unit_init), and the optimizer state over this rank's
  part (zfunc.state_init);
* the gradient part: ``value_and_grad`` over the placed units (transforms
  wrap it with ``wrap_grad``), then one small all-reduce on which every rank
  agrees on the loss, which units anyone used, whether any gradient is
  non-finite and the global gradient norm (the one read of the gradients
  before the update: zfunc.agreement);
* the update part: the optimizer, wrapped by the transforms'
  ``wrap_optimizer`` (zero1/2/3 update this rank's slice; mixed precision
  updates fp32 master weights), told what the step knows (``GradInfo``: the
  factor that unscales the gradients, their norm) so it can fold both into one
  pass.

Under fp16 loss scaling (``mixed_precision(..., loss_scale=...)``) the loss is
multiplied by the state's scale before backward; a step whose gradients
overflow on any rank is skipped on every rank and lowers the scale
(zfunc.transforms.loss_scale).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn

from . import compiled, coordinator as coordination, dist
from .agreement import Agreement, agree, agree_at_entry, same_order, summed, sure_live
from .grad import GradOut, forward, materialized, value_and_grad_with_stats
from .optim.base import GradInfo, apply_update
from .optim.reported_lr import applied_lr, next_lr
from .placement import Placement
from .state import State, fault_of, mark_failed, share_fault
from .state_init import init_state
from .transform import Transform, Units
from .traced import Jit
from .tree import Fault


@dataclass(frozen=True)
class Plan:
    """The static record a state carries: the composition that built it, and the world size."""

    composition: str
    world: int

    def describe(self) -> str:
        return f"{self.composition} at world size {self.world}"


class Step:
    """One optimizer step of ``loss_fn`` with ``optimizer``, as its transforms place it.

    The step donates its input state: parameters and optimizer state are
    updated in place and returned, so keep using the returned state only
    (a donated state passed again raises).
    """

    def __init__(self, loss_fn: Callable, optimizer, *, has_aux: bool = False, nonfinite: str = "raise",
                 transforms: tuple[Transform, ...] = ()):
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.has_aux = has_aux
        self.nonfinite = nonfinite
        self.transforms = transforms  # outermost first

    # ------------------------------------------------------------ composition

    def then(self, transform: Transform) -> "Step":
        """This step with ``transform`` applied outside the ones it has."""
        transform.check(self.transforms)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, transforms=(transform, *self.transforms))
        new.__dict__.pop("_coordinator", None)  # a new composition records its own traces
        return new

    @property
    def composition(self) -> str:
        return self._describe(self.transforms)

    def _describe(self, transforms) -> str:
        text = self._base_name
        for t in reversed(transforms):
            text = t.describe(text)
        return text

    def _setting(self, name: str):
        """The first of the transforms' settings ``name`` (zfunc.transform) that is given."""
        return next((v for t in self.transforms if (v := getattr(t, name)) is not None), None)

    @property
    def loss_scaler(self):
        """The fp16 ``LossScaler`` of ``mixed_precision``, or None."""
        return self._setting("loss_scaler")

    @property
    def accumulates(self) -> bool:
        """Whether the gradient part sums micro-batches (in fp32)."""
        return any(t.accumulates for t in self.transforms)

    def sum_home(self, spec):
        """Where one step's fp32 sums of gradients of ``spec`` live between micro-batches: the home a
        transform gives (``Transform.sum_home``), or None: device memory. The engine's imperative
        loop and the pipeline hand it to their ``GradSink`` (zfunc.transforms.sinks)."""
        return next((h for t in self.transforms if (h := t.sum_home(spec)) is not None), None)

    _base_name = "train_step"

    def coordinator(self) -> coordination.Coordinator:
        """This step's coordinator (one per step function; its traces persist across calls),
        with the settings of the outermost transform that gives them (zero3, offload_nvme)."""
        if "_coordinator" not in self.__dict__:
            settings = self._setting("prefetch") or coordination.Prefetch()
            self.__dict__["_coordinator"] = coordination.Coordinator(settings)
        return self.__dict__["_coordinator"]

    @contextlib.contextmanager
    def _coordinated(self):
        """A whole step's materializations and collectives, as one part (``continuing``)."""
        self.coordinator().begin_step()
        with self.continuing() as coordinator:
            yield coordinator

    @property
    def group(self):
        """The process group the state is sharded over (under a mesh: its shard group)."""
        return self._setting("group")

    @property
    def replicate(self):
        """Hybrid sharding (zero's ``mesh=``): the process group the state is replicated over, else None."""
        return self._setting("replicate")

    @property
    def agreement_group(self):
        """The ranks that run this step together and agree on it: the step's group, or under a mesh
        every rank (zfunc.transforms.hybrid)."""
        return None if self.replicate is not None else self.group

    @property
    def units(self):
        return self._setting("unit_policy")

    def placement(self, unit, spec=None) -> Placement:
        p = Placement()
        for t in reversed(self.transforms):
            p = t.place(p, unit) if spec is None else t.place_in(p, unit, spec, self)
        return p

    def plan(self) -> Plan:
        """What the state's layout depends on: the transforms that shape it, and W."""
        return Plan(self._describe(tuple(t for t in self.transforms if t.shapes_state)),
                    dist.world_size(self.agreement_group))

    def update_part(self, below: Transform | None = None):
        """The optimizer wrapped by the transforms (only those inside ``below``, if given)."""
        opt = self.optimizer
        for t in reversed(self.transforms):
            if t is below:
                break
            opt = t.wrap_optimizer(opt)
        return opt

    def _grad_part(self):
        recompute = self._setting("recompute")
        fn = next((f for t in self.transforms if (f := t.grad_part(self.loss_fn, self.has_aux)) is not None), None)
        if fn is not None and recompute is not None:
            raise ValueError(f"{self.composition}: a step whose gradient part is one compiled program (zf.jit) "
                             "cannot recompute units eagerly; drop zf.recompute (zf.jit(step, regather=True) "
                             "recomputes the gathers) or zf.jit (compile the blocks instead)")
        fn = fn or value_and_grad_with_stats(self.loss_fn, self.has_aux, recompute)
        for t in reversed(self.transforms):
            fn = t.wrap_grad(fn)
        return fn

    # ------------------------------------------------------------------ init

    def init(self, model: nn.Module, *, free_model: bool = True, init_fn: Callable | None = None,
             device=None, weights=None, strict: bool = True) -> State:
        """Build the state from ``model``'s parameters and buffers, or from ``weights``.

        A model built on the meta device is initialized one unit at a time
        (each module's ``reset_parameters()``, or ``init_fn(module)``:
        zfunc.unit_init) on ``device`` (default: the group's device), so init
        never holds more than a unit beyond this rank's shards. Every rank
        starts from rank 0's values.

        ``weights``: a safetensors checkpoint (the folder ``save_pretrained``
        wrote, its index, or one ``.safetensors`` file) holding the model's
        ``state_dict``: each rank reads its own part of each unit from the
        files, cast to the model's dtype (zfunc.weights); the model may be
        built on the meta device. Keys the files lack or hold beyond the model
        raise, unless ``strict=False`` (the missing ones are then initialized as
        without weights). A peft model loads its base from the base model's own
        folder (its adapters start as peft starts them), or ``weights=[BASE,
        ADAPTER, ...]`` reads the folders ``PeftModel.save_pretrained`` wrote too.

        With ``free_model`` (the default) the model's parameters are replaced
        by stand-ins that hold no storage: the state owns the weights now;
        run the model with ``zf.apply`` inside ``loss_fn``.

        An init that raises leaves nothing behind: what a transform's ``init_home`` made (swap
        files, the folders it made for them) is removed before the error goes on.
        """
        return init_state(self, model, free_model=free_model, init_fn=init_fn, device=device, weights=weights,
                          strict=strict)

    # ------------------------------------------------------------------ call

    def _check(self, state: State, *, entry: bool = False, agrees: bool = False) -> None:
        """Refuse a state this step cannot use. ``entry``: at a step's start, where a state on disk
        first agrees whether any rank's is refused (``agree_at_entry``). ``agrees``: the caller's
        own agreement refuses a failed state (``Step.begin``)."""
        if not isinstance(state, State):
            refusal = getattr(state, "refusal", None)  # zf.offload_states' value: says to reload it first
            if refusal is not None:
                raise refusal()
            raise TypeError(f"a step takes a zfunc State (from step.init(model)), got {type(state).__name__}")
        if entry:
            agree_at_entry(state, self.agreement_group, self.coordinator().settings.timeout_s)
        for t in self.transforms:
            t.check_state(state)
        fault = fault_of(state)
        if fault is not None and (fault.agreed or (dist.world_size(self.agreement_group) == 1 and not agrees)):
            raise fault.error()  # else every rank runs to the agreement, which refuses it on all of them
        if getattr(state, "_donated", False):
            raise ValueError(
                "this state was donated to a step, which updated its parameters and optimizer state in "
                "place; use the state that step returned"
            )
        if state.plan != self.plan():
            raise ValueError(
                f"this state was built by {state.plan.describe()}, but this step is "
                f"{self.plan().describe()}: build the state with this step's init"
            )

    def _buffers(self, state: State) -> dict:
        """Fresh buffers for this step: rank 0's, as DDP broadcasts them before each forward."""
        buffers = {k: v.clone() for k, v in state.buffers.items()}
        for b in buffers.values():
            dist.broadcast(b, 0, self.agreement_group)
        return buffers

    def __call__(self, state: State, batch) -> tuple[State, dict]:
        if torch.compiler.is_compiling():  # torch.compile(step): the step's own compiled form
            return _run_jitted(self, state, batch)
        started = self.begin(state)
        scaler = self.loss_scaler
        scale = None if scaler is None else float(state.loss_scale.scale)
        with self.continuing() as coordinator:
            out = self._grad_part()(state.params, batch, frozen=state.frozen, buffers=started.buffers, scale=scale)
            agreed = agree(out, coordinator.order_hash(), state, self.agreement_group, self.transforms,
                           replicate=self.replicate)
        return self._counted(self._finish(state, out, agreed, started))

    # ------------------------------------------------------- a step in parts

    def begin(self, state: State, *, agrees: bool = False) -> "Started":
        """Start a step whose gradient part the caller runs (the engine's imperative forward and
        backward, zfunc.engine.engine; the pipeline's schedule): the coordinator's passes from here on
        are this step's. Returns the fresh buffers its forwards use and what the transforms
        noted at the start (``Started``); ``apply_gradients`` ends it.

        ``agrees``: the caller agrees over more ranks than this step's group (the pipeline, over
        every stage) and refuses there a state whose update failed on any of them
        (``refused_on_every_rank``), so a failed state not yet agreed on goes on to that agreement
        here, even alone in its group, rather than raise while the others wait for it."""
        self._comm_mark = dist.comm_mark()  # metrics["comm"] counts from here (_counted)
        self._check(state, entry=True, agrees=agrees)
        marks = tuple(t.begin_step(state) for t in self.transforms)
        self.coordinator().begin_step()
        return Started(self._buffers(state), marks)

    @contextlib.contextmanager
    def continuing(self):
        """Run a part of the step ``begin`` started. Materializations follow the coordinator, which
        keeps the collectives in step with the other ranks', and collectives time out; a timeout, a
        departure from the agreed order or a failed collective becomes the error that says where
        the ranks' orders differ, or which rank did not arrive."""
        coordinator = self.coordinator()
        group = self.agreement_group
        with coordination.active(coordinator), dist.deadline(coordinator.settings.timeout_s, group):
            try:
                yield coordinator
            except (dist.CollectiveTimeout, torch.distributed.DistError) as e:
                coordinator.diverged(group, cause=e)

    def apply_gradients(self, state: State, out: GradOut, started: "Started | None" = None, *,
                        agreement: Agreement | None = None) -> tuple[State, dict]:
        """The update: end a step with the gradients the caller took (``out``, in their home form;
        ``out.grad_scale`` makes them true), as ``__call__`` does after its gradient part.

        ``started``: what ``begin`` returned (None: the state keeps its buffers). ``agreement``:
        what the ranks agreed on, if the caller reduced it itself (the pipeline engine, over every
        stage); else this step's one agreement all-reduce. Then the loss scale, and a skipped or
        applied update."""
        self._check(state)
        if agreement is None:
            with self.continuing() as coordinator:
                agreement = agree(out, coordinator.order_hash(), state, self.agreement_group, self.transforms,
                                  replicate=self.replicate)
        return self._counted(self._finish(state, out, agreement, started))

    def _counted(self, result: tuple[State, dict]) -> tuple[State, dict]:
        """``metrics["comm"]``: the collectives issued since this step's ``begin`` (zfunc.dist's
        counts: calls and bytes per group and kind), the update's included."""
        mark = self.__dict__.pop("_comm_mark", None)
        if mark is not None:
            result[1]["comm"] = dist.comm_since(mark)
        return result

    def _finish(self, state: State, out: GradOut, agreed: Agreement, started: "Started | None"
                ) -> tuple[State, dict]:
        """Everything after the agreement: metrics, the loss scale, a skipped or applied update."""
        if not agreed.same_order:
            self.coordinator().diverged(self.agreement_group)
        buffers = state.buffers if started is None else started.buffers
        scaler = self.loss_scaler
        scale = None if scaler is None else float(state.loss_scale.scale)
        loss, aux, grads, grad_scale = out.loss, out.aux, out.grads, out.grad_scale
        metrics = {"loss": agreed.loss, "grad_bytes": grads.nbytes(), "peak_materialized_bytes": out.peak,
                   "skipped": False, "grad_norm": math.sqrt(agreed.sq_norm) * grad_scale,
                   "prefetch": coordination.merge(out.prefetch)}
        if self.has_aux:
            metrics["aux"] = aux
        if scaler is not None:
            metrics["loss_scale"] = scale
            loss_scale = scaler.update(state.loss_scale, overflow=bool(agreed.nonfinite))  # raises when stuck
            metrics["skipped_steps"] = int(loss_scale.skipped)
        else:
            loss_scale = state.loss_scale
        count = state.count + 1
        if agreed.nonfinite:
            if scaler is None and self.nonfinite == "raise":
                raise FloatingPointError(
                    f"step {int(state.count)}: non-finite gradient (inf or NaN) in "
                    f"{agreed.nonfinite[0]}" + (f" and {len(agreed.nonfinite) - 1} more" if len(agreed.nonfinite) > 1 else "")
                    + "; the state was not updated. Look for inf/NaN in the batch or the loss, or lower the "
                    "learning rate; zf.train_step(..., nonfinite='skip') skips such steps instead"
                )
            metrics["skipped"] = True
            metrics["lr"] = next_lr(self.optimizer, state.opt_state)  # what it would have used (zfunc.optim.reported_lr)
            return State(state.params, state.opt_state, state.frozen, buffers, count, state.plan, loss_scale), metrics
        del loss
        info = GradInfo(scale=grad_scale, sq_norm=agreed.sq_norm, live=sure_live(agreed.live, grads.spec))
        try:
            params, opt_state = apply_update(self.update_part(), grads, state.opt_state, state.params, info=info)
        except BaseException as e:  # the state given is partly updated in place: refused from now on
            fault = fault_of(state) or Fault()
            fault.record(e, f"step {int(state.count)}'s optimizer update")
            mark_failed(state, fault)
            if fault.cause is e:
                e.add_note(f"zfunc: {fault.error()}")
            raise
        object.__setattr__(state, "_donated", True)
        metrics["lr"] = applied_lr(info)
        if started is not None:  # e.g. offload_nvme: this step's disk traffic
            for t, mark in zip(self.transforms, started.marks):
                metrics.update(t.step_metrics(state, mark))
        new = State(params, opt_state, state.frozen, buffers, count, state.plan, loss_scale)
        share_fault(state, new, getattr(params, "fault", None))  # a failure yet to come refuses both
        return new, metrics


@compiled.eager
def _run_jitted(step: Step, state: State, batch):
    """What ``torch.compile(step)(state, batch)`` runs: dynamo cannot trace a step (its gathers, its
    coordinator and its update are Python around the model), so it runs the step whose forward and
    backward are one compiled program, ``zf.jit(step)`` (torch.compile's defaults; pass options to
    ``zf.jit``). Said once per step."""
    jitted = step.__dict__.get("_jitted")
    if jitted is None:
        warnings.warn("torch.compile(step) runs zf.jit(step): the step's forward and backward compiled as one "
                      "program with torch.compile's defaults; write zf.jit(step, backend=..., mode=...) to choose",
                      compiled.CompileWarning, stacklevel=3)
        jitted = step.__dict__["_jitted"] = step.then(Jit({}))
    return jitted(state, batch)


class Started(NamedTuple):
    """A step ``Step.begin`` started: the fresh buffers its forwards use, and what each transform
    noted at its start (``Transform.begin_step``), for ``Step.apply_gradients``."""

    buffers: dict
    marks: tuple


class EvalStep(Step):
    """``(state, batch) -> metrics``: the loss under the same placement, no update."""

    _base_name = "eval_step"

    def __init__(self, loss_fn: Callable, *, has_aux: bool = False, transforms=()):
        super().__init__(loss_fn, None, has_aux=has_aux, transforms=transforms)

    def plan(self) -> Plan:
        # an eval step reads states of the train step composed the same way
        plan = super().plan()
        return Plan(plan.composition.replace("eval_step", "train_step", 1), plan.world)

    @torch.no_grad()
    def __call__(self, state: State, batch) -> dict:
        """``metrics["loss"]``: the mean over ranks (and, under ``accumulate``, micro-batches);
        ``metrics["comm"]``: its collectives, as a train step's."""
        mark = dist.comm_mark()
        self._check(state, entry=True)
        micro = next((m for t in self.transforms if (m := t.micro_batches(batch)) is not None), None)
        several = micro is not None
        micro = micro if several else [batch]
        losses, auxes = [], []
        passes = ()
        with self._coordinated() as coordinator:
            for mb in micro:
                with materialized(state.params, state.frozen, self._buffers(state),
                                  differentiable=False) as (view, tracker, _):
                    out = forward(self.loss_fn, view, tracker, mb)
                passes += tracker.prefetch
                losses.append((out[0] if self.has_aux else out).detach().float().reshape(()))
                auxes.append(out[1] if self.has_aux else None)
            h = float(coordinator.order_hash())
            vec = summed([torch.stack(losses).mean().item(), h, h * h], state, self.agreement_group,
                         "its eval step's agreement")
        w = dist.world_size(self.agreement_group)
        if not same_order(vec[1], vec[2], w):
            coordinator.diverged(self.agreement_group)
        metrics = {"loss": torch.tensor(vec[0] / w, dtype=torch.float32),
                   "prefetch": coordination.merge(passes), "comm": dist.comm_since(mark)}
        if self.has_aux:
            metrics["aux"] = auxes if several else auxes[0]
        return metrics


def train_step(loss_fn: Callable, optimizer, *, has_aux: bool = False, units=None, nonfinite: str = "raise") -> Step:
    """The base step: ``value_and_grad(loss_fn)`` then ``optimizer``. Replicated, like DDP.

    ``units``: the unit policy (see ``zf.zero3``). ``nonfinite``: what an
    inf/NaN gradient on any rank does, ``"raise"`` (naming the step and the
    unit; the state is left as it was) or ``"skip"`` (no update that step;
    ``metrics["skipped"]``).
    """
    return set_units(Step(loss_fn, optimizer, has_aux=has_aux, nonfinite=nonfinite), units)


def eval_step(loss_fn: Callable, *, has_aux: bool = False, units=None) -> EvalStep:
    """Evaluate ``loss_fn`` on a state; compose with the same transforms as the train step."""
    return set_units(EvalStep(loss_fn, has_aux=has_aux), units)


def set_units(step: Step, policy) -> Step:
    """The unit policy for every transform of ``step`` (see ``zf.zero3``'s ``units``)."""
    expect_step(step, "units")
    if policy is None or step.units is policy or step.units == policy:
        return step
    return step.then(Units(policy))


def expect_step(step, transform: str) -> None:
    """What every transform function checks first: ``step`` is a zfunc Step."""
    if not isinstance(step, Step):
        raise TypeError(f"{transform} transforms a zfunc Step (zf.train_step or zf.eval_step), got {type(step).__name__}")
