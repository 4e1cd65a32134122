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
micro-batches it takes the same steps as ``train_batch``. The step in progress is kept
by zfunc.engine.imperative; the engine counts the micro-steps. Checkpoints are
zfunc.checkpoint's, with the engine's counters, the config and the model's
``state_dict`` keys in the manifest. ``engine.compile()`` (or the config's ``compile``
section) compiles the model's blocks in place, zfunc gathering each unit outside the
compiled code; under ``compile.deepcompile`` the step is ``zf.jit``'s, traced whole.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from .. import checkpoint, compiled, dist
from ..checkpoint import client_state as client_state_file
from ..checkpoint.files import read_json
from ..checkpoint.folders import MANIFEST
from .compose import build_optimizer, compile_arguments, compile_blocks, compose, resolve_backend
from ..grad import apply, apply_method, forward as run_forward, materialized, scalar_loss
from ..residency import Bound
from .imperative import Window
from .handles import OptimizerHandle, SchedulerHandle
from .loop import Loop
from . import sixteen_bit
from ..step import eval_step, train_step


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

        if isinstance(batch, MethodCall):
            return apply_method(model, params, batch.name, batch.args, batch.kwargs)
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


class MethodCall(NamedTuple):
    """A call of the model's method ``name`` in place of its forward (``Engine.call_method``)."""

    name: str
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
    if isinstance(batch, MethodCall):
        return _tokens(batch.kwargs or batch.args)
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values()), None))
        return _tokens(first) if first is not None else 0
    if isinstance(batch, (tuple, list)) and batch:
        return _tokens(batch[0])
    return 0


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
        opt, self.lr_schedule = build_optimizer(cfg, optimizer, lr_scheduler, model)
        self.optimizer_fn = opt
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
        self._window: Window | None = None  # the imperative style's step in progress (zfunc.engine.imperative)
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's, over the count
        # what deepspeed.initialize returns beside the engine (zfunc.engine.handles)
        self.optimizer = OptimizerHandle(self)
        self.lr_scheduler = SchedulerHandle(self) if self.lr_schedule is not None else None
        self.training_dataloader = None  # zfunc.deepspeed.initialize's, given training_data

    @property
    def module(self) -> Bound:
        """The model on the engine's current weights (DeepSpeed's ``engine.module``):
        ``engine.module(x)``, ``engine.module.generate(...)`` each run inside ``zf.bind``, every
        rank calling them; units gathered as the forward reaches them, no gradients."""
        return Bound(lambda: self.state, self.model)

    @property
    def training(self) -> bool:
        """Whether the model is in training mode (``engine.train()``, ``engine.eval()``)."""
        return self.model.training

    def train(self, mode: bool = True) -> "Engine":
        """The model's training mode, as DeepSpeed's ``engine.train()`` sets it (dropout on)."""
        self.model.train(mode)
        return self

    def eval(self) -> "Engine":
        """The model's evaluation mode (DeepSpeed's ``engine.eval()``)."""
        return self.train(False)

    # ------------------------------------------------------------------- batches

    COUNTERS = Loop.COUNTERS + ("micro_steps",)

    def _pull(self, data_iter: Iterator) -> list:
        if data_iter is None:
            raise ValueError("train_batch needs data_iter: an iterator over micro-batches (e.g. iter(RepeatingLoader(loader)))")
        return self._next_micro_batches(data_iter)

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step on the next ``gradient_accumulation_steps`` micro-batches; the mean loss."""
        self._no_step_in_progress("train_batch")
        micro = self._pull(data_iter)
        batch = micro if self.gradient_accumulation_steps() > 1 else micro[0]
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
        return self._run(self._batch(inputs, kwargs))

    forward = __call__

    def call_method(self, name: str, *args, **kwargs):
        """``model.<name>(*args, **kwargs)`` run as ``engine(batch)`` runs the forward (differentiable
        with gradients on, an evaluation without): a model's other entry point, such as a reward
        model's ``forward_value``, which DeepSpeed's clients call on the engine."""
        return self._run(MethodCall(name, args, kwargs))

    def _run(self, batch):
        if self._window is not None:
            self._window.close_orphans()
        if not torch.is_grad_enabled():  # buffers (running statistics) are updated as the model's would be
            buffers = self.state.buffers if self._window is None else self._window.buffers
            self.eval_fn.coordinator().begin_step()
            with self.eval_fn.continuing(), materialized(self.state.params, self.state.frozen, buffers,
                                                         differentiable=False) as (view, tracker, _):
                return run_forward(self._forward_fn, view, tracker, batch)
        if self._window is None:
            self._window = Window(self.step_fn, self.state)
        out = self._window.forward(self.step_fn, self.state, self._forward_fn, batch)
        self._window.tokens += _tokens(batch) * self.world
        return out

    def _batch(self, inputs: tuple, kwargs: dict):
        if self._loss_fn is not None and (len(inputs) != 1 or kwargs):
            raise TypeError("with loss_fn, engine(batch) takes one batch (what loss_fn(model, batch) gets), got "
                            f"{len(inputs)} positional and {len(kwargs)} keyword inputs")
        if not kwargs:
            if not inputs:
                raise TypeError("engine() needs the model's inputs: engine(batch)")
            return inputs[0] if len(inputs) == 1 else inputs
        return kwargs if not inputs else _Inputs(inputs, kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Differentiate ``loss`` (a scalar built from what ``engine(batch)`` returned), as DeepSpeed's
        ``engine.backward``: its gradients are added to the step's, scaled by
        ``1/gradient_accumulation_steps`` (and fp16's loss scale, unscaled in the update), until the
        ``step()`` at the accumulation boundary. Returns ``loss / gradient_accumulation_steps``.
        ``scale_wrt_gas=False`` (transformers' Trainer, whose loss is already divided): the
        gradients are added as they are, and ``loss`` is returned as it is.
        """
        scalar_loss(loss, "engine.backward takes")
        window = self._window
        if window is not None:
            window.close_orphans()
        if window is None or not window.passes or not loss.requires_grad:
            raise ValueError(
                "engine.backward(loss): the loss must be built from what engine(batch) returned with gradients on "
                "(not under torch.no_grad()), since the last backward through it or the last update")
        gas = self.gradient_accumulation_steps()
        try:  # at the boundary, whole gradients are reduced now
            window.backward(self.step_fn, loss, self.is_gradient_accumulation_boundary(), retain_graph,
                            1.0 if scale_wrt_gas else float(gas))
        except BaseException:  # the step's sums are incomplete: it is abandoned
            self._window = None
            raise
        return loss.detach() / gas if scale_wrt_gas else loss.detach()

    def step(self) -> None:
        """The update, at a gradient accumulation boundary (every ``gradient_accumulation_steps``-th
        call, as DeepSpeed's ``step``), on the gradients of every ``backward`` since the last one;
        otherwise only the micro-step is counted."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._step_applied = False
            return
        window, self._window = self._window, None
        if window is not None:
            window.drop()  # forwards no backward went through
        if window is None or not window.losses:
            raise ValueError("engine.step() at a gradient accumulation boundary, but no engine.backward(loss) since "
                             "the last update: run loss = engine(batch); engine.backward(loss) first")
        out = window.grad_out(self.step_fn.agreement_group, self.gradient_accumulation_steps())
        self.state, metrics = self.step_fn.apply_gradients(self.state, out, window.started)
        self.micro_steps += 1
        self._stepped(metrics, window.tokens, time.perf_counter() - window.start)

    def zero_grad(self) -> None:
        """DeepSpeed's ``engine.zero_grad()``: see ``engine.optimizer.zero_grad``."""
        self.optimizer.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` makes the update (DeepSpeed's rule, on its count of steps,
        unless ``set_gradient_accumulation_boundary`` said otherwise)."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the next ``backward`` / ``step()`` is the accumulation boundary, over the count
        (DeepSpeed's; accelerate calls it before each backward with its own sync flag, so an epoch
        whose last update has fewer micro-batches ends with an update, as under DeepSpeed). Holds
        until it is set again, as in DeepSpeed."""
        self._boundary = bool(is_boundary)

    def _no_step_in_progress(self, what: str) -> None:
        """Forwards no backward went through are dropped; a step with gradients must end first."""
        window = self._window
        if window is None:
            return
        if window.losses:
            raise ValueError(f"{what} in the middle of an imperative step (engine.backward since the last "
                             "update): call engine.step() at the accumulation boundary first")
        self._window = None
        window.drop()

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

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """The whole training state under ``save_dir/tag`` (default ``global_step{N}``, as DeepSpeed
        names it) and ``save_dir/latest`` naming it; every rank calls it; returns the checkpoint's
        folder (zfunc.checkpoint). ``client_state``: a dict ``load_checkpoint`` returns (plain data
        in the manifest, anything else torch can pickle beside it: zfunc.checkpoint.client_state).
        ``exclude_frozen_parameters=True`` (every peft save of transformers' Trainer): the
        checkpoint is marked so, and its load keeps the frozen parameters the loading model holds,
        as DeepSpeed's (the files still hold them: zfunc's checkpoint format writes every unit).
        DeepSpeed's ``save_latest=False`` raises."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if not save_latest:
            raise NotImplementedError("save_checkpoint(save_latest=False) is not supported yet: a zfunc checkpoint "
                                      "always updates save_dir/latest when it is complete")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        client, files = client_state_file.pack(client_state)
        extra = {"engine": self._counters(),
                 "scheduler": {"last_step": int(self.state.count)},
                 "config": self.config.raw, "state_dict_keys": self.state_dict_keys,
                 **client, "frozen_excluded": bool(exclude_frozen_parameters)}
        lrs = getattr(self.optimizer, "live_lrs", lambda: None)()
        if lrs is not None:
            extra["live_lrs"] = lrs
        return checkpoint.save(self.state, save_dir, tag, extra=extra, group=self.group, files=files)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size and composition; returns ``(its folder,
        client_state)``. Without ``tag``, the one ``load_dir/latest`` names; with no ``latest``
        there, ``(None, None)`` and a warning, as DeepSpeed returns. DeepSpeed's partial loads keep
        parts of this engine's state as they are:

        - a checkpoint saved with ``exclude_frozen_parameters=True``: the frozen parameters;
        - ``load_optimizer_states=False``: the optimizer's moments and per-parameter step counts
          (the weights, fp32 master weights included, the update count, which the lr schedule
          follows, and the engine's counters are loaded, as DeepSpeed loads its scheduler and
          counters then);
        - ``load_module_only=True``: everything but the weights (DeepSpeed's warm start): the
          optimizer state, the update count and the engine's counters; under mixed precision the
          fp32 master weights are the checkpoint's (DeepSpeed's are rebuilt from its 16-bit ones);
        - ``load_lr_scheduler_states=False`` with one of those two: the update count too. Alone it
          is refused: the schedule is the optimizer's update count, loaded with its moments.

        ``load_module_strict=False`` is accepted (zfunc's checkpoint is of the same model, checked
        name by name); ``custom_load_fn`` is refused."""
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported: zfunc loads the state "
                                      "its checkpoint holds")
        if not load_lr_scheduler_states and load_optimizer_states and not load_module_only:
            raise NotImplementedError("load_checkpoint(load_lr_scheduler_states=False) with the optimizer's states "
                                      "is not supported: zfunc's lr schedule follows the optimizer's update count, "
                                      "loaded with its moments; pass load_optimizer_states=False too")
        self._no_step_in_progress("load_checkpoint")
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            warnings.warn(f"no checkpoint loaded: {load_dir!r} has no 'latest' file; pass tag= to name one",
                          UserWarning, stacklevel=2)
            return None, None
        folder = checkpoint.resolve(load_dir, tag)
        excluded = read_json(os.path.join(folder, MANIFEST)).get("frozen_excluded", False)
        kept = _kept_parts(self.state, lambda role: (
            (excluded and role == "frozen")
            or (load_module_only and role not in ("params", "master", "frozen") and not role.startswith("buffers"))
            or (not load_optimizer_states and role.startswith("opt_state")
                and (not role.endswith(".count") or not load_lr_scheduler_states))))
        self.state, manifest = checkpoint.load(self.state, load_dir, tag, group=self.group)
        _put_back(self.state, kept)
        if not load_module_only:
            self._restore_counters(manifest)
            restore = getattr(self.optimizer, "restore_live_lrs", None)
            if restore is not None and load_lr_scheduler_states:
                restore(manifest.get("live_lrs"))
        return folder, client_state_file.unpack(folder, manifest)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The model's ``state_dict`` in its compute dtype (fp16 / bf16 when enabled, else fp32) as
        ``save_dir/save_filename``, written with ``torch.save`` by rank 0, as DeepSpeed's; under ZeRO-3
        only with ``stage3_gather_16bit_weights_on_model_save`` (zfunc.engine.sixteen_bit). Every
        rank calls it; returns whether it wrote."""
        return sixteen_bit.save(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """``save_16bit_model``'s old name (DeepSpeed keeps it)."""
        return self.save_16bit_model(save_dir, save_filename)

    def destroy(self) -> None:
        """DeepSpeed's name for ``close``."""
        self.close()

    def close(self) -> None:
        """Remove the state's swap files (offload to NVMe)."""
        if self._window is not None:
            self._window, window = None, self._window
            window.drop()
        super().close()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False,
                       path: str | None = None) -> None:
        """DeepSpeed's ``engine.offload_states``: the state's parts off the device until
        ``reload_states`` (zfunc.engine.residency; docs/rl.md)."""
        from . import residency
        residency.offload(self, include, device, pin_memory, non_blocking, path)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``engine.reload_states``: the state back on the device (zfunc.engine.residency)."""
        from . import residency
        residency.reload(self, non_blocking)


def _kept_parts(state, keep) -> dict[str, list[torch.Tensor]]:
    """Copies of this rank's parts of ``state`` whose role (zfunc.checkpoint's name for a part:
    ``params``, ``master``, ``frozen``, ``opt_state[1].mu``, ``count``...) ``keep`` picks, put back
    after a load by ``_put_back``."""
    from .. import swap
    from ..checkpoint.sharded import _parts
    out = {}
    for role, node in zip(*_parts(state)[:2]):
        if not keep(role):
            continue
        leaves = list(node.leaves) if hasattr(node, "leaves") else [node]
        if any(leaf is not None and swap.on_disk(leaf) for leaf in leaves):
            raise NotImplementedError(f"a partial load_checkpoint keeping {role!r}, which lives on NVMe "
                                      "(offload_nvme): not supported; load the whole state")
        out[role] = [None if leaf is None else leaf.detach().clone() for leaf in leaves]
    return out


def _put_back(state, kept: dict[str, list[torch.Tensor]]) -> None:
    from ..checkpoint.sharded import _parts
    for role, node in zip(*_parts(state)[:2]):
        if role in kept:
            leaves = list(node.leaves) if hasattr(node, "leaves") else [node]
            with torch.no_grad():
                for leaf, value in zip(leaves, kept[role]):
                    if leaf is not None:
                        leaf.copy_(value)


def _args(kw: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())
