"""The engine: a DeepSpeed-style config composed into one zfunc step, and the loop around it.

``zf.initialize(model, config)`` reads the config (zfunc.engine.config), composes the
transforms a user would write by hand::

    zeroN(offload_*(mixed_precision(accumulate(train_step(loss, chain(clip, optimizer)), gas))))

and keeps the state. ``train_batch(data_iter)`` pulls the gradient accumulation
steps' micro-batches and makes one step. The imperative style of ported
DeepSpeed scripts (``out = engine(batch); engine.backward(loss); engine.step()``)
runs the same parts with DeepSpeed's semantics: ``engine(batch)`` is the forward
(each one a materialization kept open, with its graph, until a backward goes
through it: zfunc.grad.materialized), ``backward`` sends each unit's gradient into
the step's sums (an ``accumulate`` ``GradSink``), and the ``step()`` at the
accumulation boundary makes the update (``Step.apply_gradients``); on the same
micro-batches it takes the same steps as ``train_batch``. Checkpoints are
zfunc.checkpoint's, with the engine's counters, the config and the model's
``state_dict`` keys in the manifest. ``engine.compile()`` (or the config's ``compile``
section) compiles the model's blocks in place, zfunc gathering each unit outside the
compiled code; under ``compile.deepcompile`` the step is ``zf.jit``'s, traced whole.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from .. import checkpoint, compiled, dist, lazy, swap
from .compose import build_optimizer, compile_arguments, compile_blocks, compose, resolve_backend
from ..transforms.sinks import GradSink, Sink
from ..grad import GradOut, apply, forward as run_forward, grad_spec, materialized, merge_live, scalar_loss
from .loop import Loop
from ..materialize import Materialize
from ..step import Step, eval_step, train_step
from ..tree import Params


class RepeatingLoader:
    """Iterates ``loader`` forever, starting it again when it ends (DeepSpeed's RepeatingLoader)."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def model_forward(model: nn.Module, loss_fn: Callable | None) -> Callable:
    """``(params, batch) -> what engine(batch) returns``: the user's ``loss_fn(model, batch)``,
    or without it the model's output on the batch (``model(**batch)`` for a mapping,
    ``model(*batch)`` for a tuple or list, ``model(batch)`` otherwise; ``model(*args, **kw)``
    for inputs given as ``_Inputs``)."""

    def run_model(params, batch):
        def run(*args, **kw):
            return apply(model, params, *args, **kw)

        if loss_fn is not None:
            return loss_fn(run, batch)
        if isinstance(batch, _Inputs):
            return run(*batch.args, **batch.kwargs)
        if isinstance(batch, dict):
            return run(**batch)
        if isinstance(batch, (tuple, list)):
            return run(*batch)
        return run(batch)

    return run_model


def model_loss(model: nn.Module, loss_fn: Callable | None) -> Callable:
    """The step's ``loss_fn(params, batch)`` from a model and the user's ``loss_fn(model, batch)``.

    Without ``loss_fn`` the model computes its own loss from the batch (see
    ``model_forward``): its output is the loss, has ``.loss``, or starts with it. With
    ``loss_fn``, it gets the model as a function (run on the state's parameters) and the
    batch: ``loss_fn=lambda model, b: F.cross_entropy(model(b[0]), b[1])``.
    """
    run_model = model_forward(model, loss_fn)
    if loss_fn is not None:
        return run_model
    return lambda params, batch: _the_loss(run_model(params, batch))


class _Inputs(NamedTuple):
    """``engine(*args, **kwargs)`` given both positional and keyword inputs: the model's call."""

    args: tuple
    kwargs: dict


def _the_loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        value = out
    elif getattr(out, "loss", None) is not None:
        value = out.loss
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        value = out[0]
    else:
        raise TypeError(
            f"the model returned {type(out).__name__}, not a loss: without loss_fn the model must compute its "
            "own loss (a tensor, an output with .loss, or a tuple starting with it); or pass "
            "loss_fn=lambda model, batch: ... to zf.initialize")
    return scalar_loss(value, "the model's loss must be", ": if the model returns outputs rather than its loss, "
                       "pass loss_fn=lambda model, batch: ...", ValueError)


def _tokens(batch) -> int:
    """Tokens (or samples) in a micro-batch: the elements of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values()), None))
        return _tokens(first) if first is not None else 0
    if isinstance(batch, (tuple, list)) and batch:
        return _tokens(batch[0])
    return 0


class _StepSums(GradSink):
    """The gradient sums of an imperative step (zfunc.transforms.sinks's ``GradSink``), noting which
    passes each backward reached (the trackers of the units whose gradients it took)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.reached: set = set()

    def take(self, unit, grad_full: torch.Tensor) -> None:
        self.reached.add(unit.tracker)
        super().take(unit, grad_full)

    def take_parts(self, unit, grads) -> None:
        self.reached.add(unit.tracker)
        super().take_parts(unit, grads)


class _Spent(Sink):
    """The sink of a closed pass: a backward through its output would put gradients nowhere."""

    def takes_parts(self, unit) -> bool:
        raise RuntimeError(
            "backward through the output of an engine(batch) whose pass is over: an earlier engine.backward "
            "went through it, or engine.step() made the update after it. Run engine(batch) again; to "
            "backward twice through one output, pass retain_graph=True to the first engine.backward")

    def take(self, unit, grad_full: torch.Tensor) -> None:
        self.takes_parts(unit)


class _Unfinished(Exception):
    """Closes a pass no backward went through: it did not complete, so its order is not recorded
    as a trace for the coordinator to prefetch along (zfunc.grad.materialized)."""


class _Pass:
    """One ``engine(batch)`` with gradients on: its units' materialization (zfunc.grad.materialized)
    stays open, the graph kept, until a backward has gone through it, the update ends the step,
    or the graph is gone (nothing can backward through it any more)."""

    def __init__(self, context, sums: _StepSums):
        self.context = context
        self.view, self.tracker, _ = context.__enter__()
        self.tracker.sink = sums
        self.alive = 0  # this pass's Materialize nodes still in some graph
        self.orphaned = False
        self.watches: list = []

    def watch(self, out) -> None:
        """Note when the graph from ``out`` to this pass's units is gone (if ``out``'s tensors
        can be found: tensors in tuples, lists and mappings)."""
        for node in _materializations(out, self.tracker):
            self.alive += 1
            self.watches.append(weakref.finalize(node, self._gone))

    def _gone(self) -> None:
        self.alive -= 1
        self.orphaned = self.alive == 0

    def close(self, error: BaseException | None = None) -> None:
        for w in self.watches:
            w.detach()
        # with an error the set-up ends as if it was raised inside (it is not raised again here)
        self.context.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)
        self.tracker.sink = _Spent()


def _materializations(out, tracker) -> list:
    """The ``Materialize`` nodes of ``tracker``'s units that ``out``'s graph reaches: they live as
    long as a graph through that pass does."""
    todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    seen, found = set(), []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is Materialize._backward_cls:
            if node.unit.tracker is tracker:
                found.append(node)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class _Window:
    """The imperative style's step in progress: from the first ``engine(batch)`` with gradients
    on to the ``step()`` that updates."""

    def __init__(self, step: Step, state):
        self.start = time.perf_counter()
        self.started = step.begin(state)
        self.buffers = self.started.buffers
        scaler = step.loss_scaler
        self.scale = None if scaler is None else float(state.loss_scale.scale)
        self.sums = _StepSums(grad_spec(state.params.spec))
        self.passes: list[_Pass] = []  # open: awaiting a backward
        self.losses: list[torch.Tensor] = []  # one per backward
        self.unreduced = False  # whole gradients were added since the last reduction
        self.peak = 0
        self.prefetch: tuple = ()
        self.live: dict = {}  # which parameters the backwards so far gave a gradient (GradOut.live)
        self.tokens = 0

    def close(self, passes: list[_Pass], error: BaseException | None = None) -> None:
        for p in passes:
            self.passes.remove(p)
            p.close(error)
            self.peak = max(self.peak, p.tracker.peak)
            self.prefetch += p.tracker.prefetch
            self.live = merge_live(self.live, p.tracker.got)

    def close_orphans(self) -> None:
        self.close([p for p in self.passes if p.orphaned], _Unfinished())


class Engine(Loop):
    """Owns the model's state and the composed step; see the module docstring."""

    def __init__(self, model: nn.Module, cfg, *, loss_fn=None, optimizer=None, lr_scheduler=None, weights=None,
                 strict: bool = True):
        self.config = cfg
        self.model = model
        self.group = None
        self.world = dist.world_size()
        self.rank = dist.rank()
        self.state_dict_keys = [compiled.plain_name(k) for k in model.state_dict()]  # without _orig_mod.
        loss = model_loss(model, loss_fn)
        opt, self.lr_schedule = build_optimizer(cfg, optimizer, lr_scheduler)
        self._train_base = train_step(loss, opt)
        self.step_fn = compose(cfg, self._train_base)
        self.eval_fn = compose(cfg, eval_step(loss))
        self._compiled: dict | None = None  # torch.compile's arguments, once compiled
        c = cfg.compile
        if c is not None and c.deepcompile:  # compose wrapped the step in zf.jit
            self._compiled = {**c.kwargs, "backend": resolve_backend(c.backend, "compile.backend")}
        elif c is not None and c.enabled:  # DeepSpeed's first compile section: compiled at initialize
            kw = {**c.kwargs, "backend": resolve_backend(c.backend, "compile.backend")}
            compile_blocks(model, kw)
            self._compiled = kw
        self._forward_fn = model_forward(model, loss_fn)
        self._loss_fn = loss_fn
        self.state = self.step_fn.init(model, weights=weights, strict=strict)  # weights: zfunc.weights
        self._start_counting()
        self.micro_steps = 0  # step() calls (DeepSpeed's count), gradient_accumulation_steps per train_batch
        self._window: _Window | None = None  # the imperative style's step in progress

    # ------------------------------------------------------------------- batches

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch_size

    COUNTERS = Loop.COUNTERS + ("micro_steps",)

    def _pull(self, data_iter: Iterator) -> list:
        if data_iter is None:
            raise ValueError("train_batch needs data_iter: an iterator over micro-batches (e.g. iter(RepeatingLoader(loader)))")
        return self._next_micro_batches(data_iter)
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step on the next ``gradient_accumulation_steps`` micro-batches; the mean loss."""
        self._no_step_in_progress("train_batch")
        micro = self._pull(data_iter)
        batch = micro if self.gradient_accumulation_steps > 1 else micro[0]
        start = time.perf_counter()
        self.state, metrics = self.step_fn(self.state, batch)
        self.micro_steps += len(micro)
        self._stepped(metrics, sum(_tokens(b) for b in micro) * self.world, time.perf_counter() - start)
        return metrics["loss"]

    def eval_batch(self, data_iter: Iterator) -> torch.Tensor:
        """The mean loss over the next ``gradient_accumulation_steps`` micro-batches; no update."""
        losses = [self.eval_fn(self.state, b)["loss"] for b in self._pull(data_iter)]
        return torch.stack(losses).mean()

    # ------------------------------------------------------- the imperative style

    def __call__(self, *inputs, **kwargs):
        """What the model returns on the inputs (the loss of ``loss_fn`` if ``initialize`` was given
        one), as DeepSpeed's ``engine(batch)``.

        With gradients on, the output is differentiable: the units' materialization stays open
        and the graph kept until ``backward`` goes through it (or the output is dropped, or
        ``step()`` makes the update). Under ``torch.no_grad()`` it is an evaluation: nothing is kept.
        ``engine(batch)`` takes a batch as ``train_batch``'s micro-batches are taken (a mapping is
        the model's keyword arguments, a tuple its positional ones); ``engine(x, y, key=v)`` calls
        the model so.
        """
        batch = self._batch(inputs, kwargs)
        if self._window is not None:
            self._window.close_orphans()
        if not torch.is_grad_enabled():  # buffers (running statistics) are updated as the model's would be
            buffers = self.state.buffers if self._window is None else self._window.buffers
            self.eval_fn.coordinator().begin_step()
            with self.eval_fn.continuing(), materialized(self.state.params, self.state.frozen, buffers,
                                                         differentiable=False) as (view, tracker, _):
                return run_forward(self._forward_fn, view, tracker, batch)
        if self._window is None:
            self._window = _Window(self.step_fn, self.state)
        window = self._window
        with self.step_fn.continuing():
            p = _Pass(materialized(self.state.params, self.state.frozen, window.buffers, differentiable=True),
                      window.sums)
            window.passes.append(p)
            try:
                out = run_forward(self._forward_fn, p.view, p.tracker, batch)
            except BaseException as e:
                window.close([p], e)
                raise
        p.watch(out)
        window.tokens += _tokens(batch) * self.world
        return out

    forward = __call__

    def _batch(self, inputs: tuple, kwargs: dict):
        if self._loss_fn is not None and (len(inputs) != 1 or kwargs):
            raise TypeError("with loss_fn, engine(batch) takes one batch (what loss_fn(model, batch) gets), got "
                            f"{len(inputs)} positional and {len(kwargs)} keyword inputs")
        if not kwargs:
            if not inputs:
                raise TypeError("engine() needs the model's inputs: engine(batch)")
            return inputs[0] if len(inputs) == 1 else inputs
        return kwargs if not inputs else _Inputs(inputs, kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Differentiate ``loss`` (a scalar built from what ``engine(batch)`` returned), as DeepSpeed's
        ``engine.backward``: its gradients are added to the step's, scaled by
        ``1/gradient_accumulation_steps`` (and fp16's loss scale, unscaled in the update), until the
        ``step()`` at the accumulation boundary. Returns ``loss / gradient_accumulation_steps``.
        """
        scalar_loss(loss, "engine.backward takes")
        window = self._window
        if window is not None:
            window.close_orphans()
        if window is None or not window.passes or not loss.requires_grad:
            raise ValueError(
                "engine.backward(loss): the loss must be built from what engine(batch) returned with gradients on "
                "(not under torch.no_grad()), since the last backward through it or the last update")
        sums = window.sums
        sums.last = self.is_gradient_accumulation_boundary()  # whole gradients are reduced now
        sums.reached = set()
        try:
            with self.step_fn.continuing(), lazy.resolving(window.passes[-1].tracker):
                torch.autograd.backward(loss if window.scale is None else loss * window.scale,
                                        retain_graph=retain_graph)
                if not retain_graph:  # their gradients are all in: their gathered buffers go
                    window.close([p for p in window.passes if p.tracker in sums.reached])
        except BaseException as e:  # the step's sums are incomplete: it is abandoned
            self._window = None
            window.close(list(window.passes), e)
            raise
        sums.reached = set()
        window.unreduced = not sums.last
        window.losses.append(loss.detach().reshape(()))
        return loss.detach() / self.gradient_accumulation_steps

    def step(self) -> None:
        """The update, at a gradient accumulation boundary (every ``gradient_accumulation_steps``-th
        call, as DeepSpeed's ``step``), on the gradients of every ``backward`` since the last one;
        otherwise only the micro-step is counted."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        window, self._window = self._window, None
        if window is not None:
            window.close(list(window.passes), _Unfinished())  # forwards no backward went through
        if window is None or not window.losses:
            raise ValueError("engine.step() at a gradient accumulation boundary, but no engine.backward(loss) since "
                             "the last update: run loss = engine(batch); engine.backward(loss) first")
        grads = window.sums.grads()
        if window.unreduced:  # no backward since the boundary came: reduce whole gradients now
            _reduce_whole(grads, self.step_fn.group)
        out = GradOut(torch.stack(window.losses).mean(), None, grads, window.peak,
                      (1.0 if window.scale is None else 1.0 / window.scale) / self.gradient_accumulation_steps,
                      window.prefetch, window.live)
        self.state, metrics = self.step_fn.apply_gradients(self.state, out, window.started)
        self.micro_steps += 1
        self._stepped(metrics, window.tokens, time.perf_counter() - window.start)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` makes the update (DeepSpeed's rule, on its count of steps)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def _no_step_in_progress(self, what: str) -> None:
        """Forwards no backward went through are dropped; a step with gradients must end first."""
        window = self._window
        if window is None:
            return
        if window.losses:
            raise ValueError(f"{what} in the middle of an imperative step (engine.backward since the last "
                             "update): call engine.step() at the accumulation boundary first")
        self._window = None
        window.close(list(window.passes), _Unfinished())

    # ------------------------------------------------------------------ compiling

    def compile(self, backend="inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile the model, as DeepSpeed's ``engine.compile``: its blocks, in place
        (``zf.compile_units``: each child of every ``nn.ModuleList``, or the whole model when
        it has none), with ``torch.compile(backend=backend, **compile_kwargs)``; zfunc gathers
        each unit outside the compiled code. Under the config's ``compile.deepcompile`` the
        step is compiled whole instead (``zf.jit``) with these arguments.

        ``backend``: a name dynamo knows, the dotted path of a backend function, or a
        callable; a ``backend`` key in ``compile_kwargs`` is overridden with a warning, as in
        DeepSpeed. Called again with the same arguments it does nothing, as in DeepSpeed;
        with other arguments it recompiles before the first step and raises after it. It may
        be called after training started (the next step runs compiled). ``schedule`` (DeepCompile's
        pass schedule) and ``compiled_autograd_enabled`` are DeepSpeed's and not supported yet.
        """
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...): DeepCompile's pass schedules are not supported yet")
        if compiled_autograd_enabled:
            raise ValueError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not supported yet")
        if self._window is not None:
            raise ValueError("engine.compile() in the middle of an imperative step (engine(batch) since the last "
                             "update): call it before engine(batch) or after engine.step()")
        kw = compile_arguments(compile_kwargs, backend, "compile_kwargs")
        if self._compiled is not None:
            if kw == self._compiled:
                return  # DeepSpeed: an engine already compiled is left as it is
            if self.micro_steps:
                raise ValueError(
                    f"engine.compile({_args(kw)}): the engine is already compiled ({_args(self._compiled)}) and "
                    f"has trained {self.global_steps} step(s); compile it once (DeepSpeed ignores a second "
                    "engine.compile(), zfunc refuses one with other arguments rather than ignore them)")
        c = self.config.compile
        if c is not None and c.deepcompile:
            self.step_fn = compose(self.config, self._train_base, jit_kwargs=kw)
        else:
            compile_blocks(self.model, kw)
        self._compiled = kw

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile()`` or the config's ``compile`` section compiled the model (DeepSpeed's)."""
        return self._compiled is not None

    def is_deepcompile_enabled(self) -> bool:
        """Whether the config asks for the whole step compiled (``compile.deepcompile``; DeepSpeed's)."""
        return self.config.compile is not None and self.config.compile.deepcompile

    # ------------------------------------------------------------------ logging

    def _report_parts(self, metrics: dict, seconds: float) -> list[str]:
        parts = [f"loss scale {metrics['loss_scale']:g}"] if "loss_scale" in metrics else []
        parts += self._rate_and_memory()
        if self.config.wall_clock_breakdown:
            parts.append(f"step {seconds * 1e3:.0f} ms")
        return parts

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """Every rank calls it; returns the checkpoint's folder (zfunc.checkpoint)."""
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        extra = {"engine": self._counters(),
                 "scheduler": {"last_step": int(self.state.count)},
                 "config": self.config.raw, "state_dict_keys": self.state_dict_keys,
                 "client_state": client_state or {}}
        return checkpoint.save(self.state, save_dir, tag, extra=extra, group=self.group)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
        """Load a checkpoint saved at any world size; returns ``(its folder, client_state)``."""
        self._no_step_in_progress("load_checkpoint")
        folder = checkpoint.resolve(load_dir, tag)
        self.state, manifest = checkpoint.load(self.state, load_dir, tag, group=self.group)
        self._restore_counters(manifest)
        return folder, manifest.get("client_state", {})

    def close(self) -> None:
        """Remove the state's swap files (offload to NVMe)."""
        if self._window is not None:
            self._window, window = None, self._window
            window.close(list(window.passes), _Unfinished())
        super().close()


def _args(kw: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())


def _reduce_whole(grads: Params, group) -> None:
    """Average the gradients that go home whole (stage 0, zero1) over ``group``: the sums the
    accumulator reduces in the boundary's backward (zfunc.transforms.accumulate), when none came."""
    for g, sharded in zip(grads.leaves, grads.spec.sharded):
        if g is None or sharded:
            continue
        if swap.on_disk(g):
            raise ValueError("engine.step() at the accumulation boundary with no engine.backward since the last "
                             "step(): with gradients on NVMe, run the boundary micro-batch's backward")
        dist.all_reduce_mean(g, group)
