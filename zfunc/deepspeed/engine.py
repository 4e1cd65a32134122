"""The engine ``zfunc.deepspeed.initialize`` returns: zfunc's ``Engine`` as DeepSpeed's clients
(transformers' ``Trainer``, accelerate, peft) hold it.

Like DeepSpeed's ``DeepSpeedEngine`` it is an ``nn.Module`` whose child is the user's model
(``isinstance(engine, torch.nn.Module)``; accelerate unwraps it through ``.module``), and its
``config`` reads as the config dict (``engine.config.get("zero_optimization", {})``).

- ``engine.module`` is the user's model itself. Outside a step its forward runs on the engine's
  current weights, as inside ``zf.bind`` (each unit gathered as the forward reaches it, no
  gradients, every rank calling it), so ``engine.module(x)`` and ``engine.module.generate(...)``
  work as under DeepSpeed; inside ``engine(batch)`` it is the step's forward. Its
  ``state_dict()`` is read on the calling rank alone, as DeepSpeed's (scripts call it on rank 0
  only): at ZeRO stages 0-2 (or on one rank) the weights in the dtype the model computes in,
  what DeepSpeed's module holds; under ZeRO-3 across ranks DeepSpeed's 0-element placeholders.
  Under ZeRO-3 its parameters carry DeepSpeed's ``ds_id``, ``ds_status``, ``ds_numel`` and
  ``ds_shape``, so clients take their "gather first" branch, which ``zero.GatheredParameters``
  serves.
- ``_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=)`` and
  ``zero_gather_16bit_weights_on_model_save()`` are what accelerate and the Trainer save with.
- ``load_checkpoint`` leaves the random number generators as they are, as DeepSpeed's does (it
  saves no RNG state), where zfunc's checkpoints put back the RNG state of the save so that a
  resumed run draws what the uninterrupted one would have. A DeepSpeed script that seeds, builds
  a fresh model and loads gets DeepSpeed's dropout masks after the load.
- a model built under a ZeRO-3 ``zero.Init`` whose ``GatheredParameters`` blocks wrote values
  before ``initialize`` (transformers' ``from_pretrained`` under a ZeRO-3 config) starts from them:
  they were written to the model's spill (``zero.Spill``), read here as pretrained weights, one
  unit at a time, each rank its own bytes; the spill is removed.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from .. import dist, lazy
from ..engine import sixteen_bit
from ..engine.engine import Engine
from ..residency.binding import is_own_method
from ..state import compute_params, whole_here
from . import zero
from .zero import ZeroParamStatus


class DeepSpeedEngine(Engine, nn.Module):
    """See the module docstring."""

    def __init__(self, model: nn.Module, cfg, **kwargs):
        nn.Module.__init__(self)
        zero.unspill(model)  # placeholders back on the meta device, the spill's entries of replaced parameters dropped
        spill = zero.spilled(model)  # what GatheredParameters blocks wrote under a ZeRO-3 Init (from_pretrained)
        if spill is not None and kwargs.get("weights") is None:
            kwargs.update(weights=spill.weights(), strict=False)
        names = {id(p): n for n, p in model.named_parameters()}  # the model's own parameters, before init
        try:
            Engine.__init__(self, model, cfg, **kwargs)
        finally:
            if spill is not None:
                zero.forget_spill(model)
        now = dict(model.named_parameters())
        # what stands in for each parameter the model held (a script's optimizer's groups point there)
        self._stand_in_of = {i: now[n] for i, n in names.items() if n in now}
        _bind_outside_steps(self, model)
        if self.zero_optimization_partition_weights():
            _install_status()
            _mark_partitioned(model)

    # nn.Module.__init__ sets ``training``; the mode is the model's (Engine.train / eval)
    @property
    def training(self) -> bool:
        model = self.__dict__.get("_modules", {}).get("model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass

    def __getattr__(self, name: str):
        """What the engine lacks, the model has, as DeepSpeed's engine gives it: a method of the
        model's own (DeepSpeed-Chat's ``reward_model.forward_value(...)``) runs as ``engine(batch)``
        runs the forward (``call_method``: on the engine's weights, differentiable with gradients on);
        other attributes are the model's."""
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("_") or not hasattr(model, name):
                raise
        value = getattr(model, name)
        return functools.partial(self.call_method, name) if is_own_method(model, name, value) else value

    @property
    def module(self) -> nn.Module:
        """The user's model; outside a step it runs on the engine's weights (the module docstring)."""
        return self.model

    def load_checkpoint(self, load_dir: str, tag: str | None = None, *args, **kwargs):
        if kwargs.get("load_lr_scheduler_states") is False and self.lr_scheduler is None:
            # the script took the scheduler from the engine (Lightning: engine.lr_scheduler = None) and
            # restores it itself: DeepSpeed has no scheduler to skip here. zfunc's schedule is the update
            # count, loaded with the optimizer's states; the script's scheduler accepts a state of that
            # same update (SchedulerHandle.load_state_dict)
            kwargs["load_lr_scheduler_states"] = True
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            return super().load_checkpoint(load_dir, tag, *args, **kwargs)
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

    # ------------------------------------------------------------ 16-bit weights

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether the config's ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is set."""
        return sixteen_bit.gathers_on_save(self.config)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The model's whole ``state_dict`` in its compute dtype on rank 0 (``{}`` on the others), as
        DeepSpeed's; ``exclude_frozen_parameters``: without the parameters that do not train (a peft
        model's base). Every rank calls it."""
        keys = self.state_dict_keys
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            keys = [k for k in keys if k not in frozen]
        weights = sixteen_bit.state_dict(self.state, keys, self.config.compute_dtype)
        return weights if dist.rank() == 0 else {}

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict


def _bind_outside_steps(engine: DeepSpeedEngine, model: nn.Module) -> None:
    """The model's forward, called outside a step (no resolver of zfunc.lazy active), runs inside
    ``zf.bind`` on the engine's current state; its ``state_dict()`` gathers the stand-ins' values."""
    from ..residency import bind

    ref = weakref.ref(engine)
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        owner = ref()
        if lazy.current() is not None or owner is None:
            return original(*args, **kwargs)
        with bind(owner.state, model) as bound:
            return bound(*args, **kwargs)

    model.forward = forward
    original_state_dict = model.state_dict

    @functools.wraps(original_state_dict)
    def state_dict(*args, keep_vars: bool = False, **kwargs):
        owner = ref()
        if keep_vars or owner is None or lazy.current() is not None:  # the Parameter objects: the stand-ins
            return original_state_dict(*args, keep_vars=keep_vars, **kwargs)
        with lazy.resolving(_Gathered(owner)):
            return original_state_dict(*args, **kwargs)

    model.state_dict = state_dict
    original_apply = model._apply

    @functools.wraps(original_apply)
    def _apply(fn, *args, **kwargs):
        return _moved_around_stand_ins(model, original_apply, fn, *args, **kwargs)

    model._apply = _apply


def _moved_around_stand_ins(model: nn.Module, original_apply, fn, *args, **kwargs):
    """``model.cpu()`` / ``.to(device)`` after ``initialize`` (Lightning's teardown moves the module to
    the CPU): the weights are the engine's state, so the stand-ins stay as they are and the rest
    (buffers) moves. A cast of the weights' dtype is refused: the config's ``bf16`` / ``fp16``
    decide it."""
    held = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if lazy.is_lazy(p)]
    for m, name, p in held:
        if fn(torch.empty(0, dtype=p.dtype)).dtype != p.dtype:
            raise NotImplementedError(f"casting the model's parameters ({name}: {p.dtype}) after deepspeed.initialize "
                                      "is not supported: the engine holds the weights; set the dtype with the config's "
                                      "'bf16' / 'fp16' sections")
    for m, name, _ in held:
        m._parameters[name] = None
    try:
        return original_apply(fn, *args, **kwargs)
    finally:
        for m, name, p in held:
            m._parameters[name] = p


class _Gathered:
    """The resolver a ``state_dict()`` outside a step reads stand-ins through (zfunc.lazy), as
    DeepSpeed's module gives it, on the calling rank alone (scripts call it on rank 0 only): each
    parameter's whole value in the compute dtype where every unit is whole on this rank (ZeRO 0-2,
    or one rank); under ZeRO-3 across ranks, DeepSpeed's 0-element placeholder (its clients gather
    first: ``GatheredParameters``, ``_zero3_consolidated_16bit_state_dict``)."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine, self.values = engine, None

    def resolve(self, name: str) -> torch.Tensor:
        state, dtype = self.engine.state, self.engine.config.compute_dtype
        if self.values is None:
            names = [n for n, _ in self.engine.model.named_parameters()]
            self.values = (sixteen_bit.state_dict(state, names, dtype, params=compute_params(state))
                           if whole_here(state) else {})
        if name in self.values:
            return self.values[name]
        return torch.empty(0, dtype=dtype or torch.float32, device=dist.device_of())


def _status_of(t: torch.Tensor):
    """``tensor.ds_status`` (installed on ``torch.Tensor`` by the first ZeRO-3 engine): what was set on
    the tensor (DeepSpeed's own, zfunc's stand-ins and placeholders), else ``AVAILABLE`` inside a zfunc
    step (its forward and backward, a forward outside steps, a ``GatheredParameters`` block: every
    tensor a client holds there is a full value), else no such attribute, as for any tensor that is
    not ZeRO's. DeepSpeed's clients read it off the tensors they hold: TRL's fused LM head reads it off
    ``lm_head.weight`` in the forward (the step's view of the gathered unit) and off the weight it
    saved for backward, which autograd gives back as a new tensor object (a saved non-leaf under
    saved-tensor hooks), so no attribute set on the view could reach it."""
    d = t.__dict__
    if "ds_status" in d:
        return d["ds_status"]
    if lazy.current() is not None:
        return ZeroParamStatus.AVAILABLE
    raise AttributeError(f"'{type(t).__name__}' object has no attribute 'ds_status'")


def _set_status(t: torch.Tensor, value) -> None:
    t.__dict__["ds_status"] = value


def _install_status() -> None:
    if not isinstance(torch.Tensor.__dict__.get("ds_status"), property):
        torch.Tensor.ds_status = property(_status_of, _set_status)


def _mark_partitioned(model: nn.Module) -> None:
    """DeepSpeed's ZeRO-3 attributes on the stand-ins, which clients test (``hasattr(p, "ds_id")``)."""
    for i, p in enumerate(model.parameters()):
        if lazy.is_lazy(p):
            p.ds_id, p.ds_status = i, ZeroParamStatus.NOT_AVAILABLE
            p.ds_numel, p.ds_shape = p.numel(), p.shape
