"""Running a model on parameters, and differentiating through it.

``apply(model, params, ...)`` runs ``model`` functionally. Given the lazy
``ParamView`` that ``value_and_grad`` hands to ``loss_fn``, each unit is
materialized just before its module runs and released right after, so at
ZeRO-3 only a unit or two is ever whole. Given a plain dict it is
``torch.func.functional_call``.

``zf.bind`` (zfunc.residency.bind) runs the same machinery between steps.

Code that reads a weight any other way (another unit's weight in a module's
forward, the loss reading a head's weight, an activation checkpoint
recomputing a block in backward) reaches the model's parameter stand-ins
(zfunc.lazy), which resolve through the ``ParamView`` in forward and the
step's ``Tracker`` in backward.

``value_and_grad`` runs on ``torch.autograd.grad`` over the leaves rather than
``torch.func.grad``: the latter refuses saved-tensor hooks and in-place
collectives in a custom backward (docs/architecture.md).
"""
from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed
from torch import nn
from torch.func import functional_call

from . import compiled, dist, layout, lazy, recompute_units
from . import coordinator as coordination
from .materialize import Materializer, Tracker
from .placement import grad_is_shard
from .pytree import tree_flatten, tree_map, tree_unflatten
from .tree import ModelSpec, Params, ParamsSpec


class ParamView(Mapping):
    """``name -> Tensor`` keyed like ``model.named_parameters()``; units materialize on access.

    A unit touched outside ``apply`` (a tied head, a custom loss reading a
    weight) stays materialized until ``loss_fn`` returns.
    """

    def __init__(self, spec: ModelSpec, trainable: Materializer, frozen: Materializer | None, buffers: Mapping[str, torch.Tensor],
                 recompute: recompute_units.Policy | None = None):
        self.spec = spec
        self.recompute = recompute  # zf.recompute: the units whose modules run under checkpointing
        self._groups = {True: trainable, False: frozen}
        self.buffers = dict(buffers)
        self._scopes: list[list[tuple[Materializer, int]]] = [[]]
        self._checked: set[int] = set()
        self._own_params: list = []  # a model's own parameters, out while stand-ins resolve (free_model=False)
        self._wrapped: dict[int, Callable] = {}  # compiled blocks attached for this step -> what detaches them
        self._recomputed: dict[int, Callable] = {}  # modules under zf.recompute's checkpointing -> what puts them back
        self.running: str | None = None  # the unit whose module runs (last entered), for compile errors
        # mixed precision: floating-point inputs of zf.apply take the compute dtype (as FSDP2's
        # cast_forward_inputs), so a float32 batch runs in the model's dtype
        self.input_dtype = next((p.param_dtype for p in trainable.spec.placements if p.param_dtype), None)

    def resolve(self, name: str) -> torch.Tensor:
        """A stand-in was read (zfunc.lazy): materialize its unit in the current scope."""
        return self[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            unit, trainable = self.spec.owner_of(name)
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in this model") from None
        units = self._groups[trainable]
        views = units.acquire(unit)
        self._scopes[-1].append((units, unit))
        return views[self.spec.canonical_name(name)]

    def __iter__(self):
        return iter(self.spec.parameter_names)

    def __len__(self) -> int:
        return len(self.spec.parameter_names)

    def open_scope(self) -> None:
        self._scopes.append([])

    def close_scope(self) -> None:
        for units, unit in self._scopes.pop():
            units.release(unit)

    def close(self) -> None:
        while len(self._scopes) > 1:
            self.close_scope()
        self.close_scope()
        self._scopes = [[]]

    def restore_models(self) -> None:
        """Give models that kept their parameters their own tensors back, compiled blocks their
        own compiled code, and recomputed units their own forward."""
        lazy.restore_parameters(self._own_params)
        self._own_params = []
        for unwrap in (*self._wrapped.values(), *self._recomputed.values()):
            unwrap()
        self._wrapped, self._recomputed = {}, {}

    def run(self, model: nn.Module, args: tuple, kwargs: dict, method: str | None = None) -> Any:
        """``model(*args, **kwargs)`` on this view's tensors; ``method``: the model's method of that
        name called instead of its forward (a reward model's ``forward_value``)."""
        root, handles = self.hook_units(model)
        if compiled.is_wrapped(model):
            compiled.warn_graph_breaks(model, [u.name for u in self.spec.units if u.name])
        if self.input_dtype is not None:
            args, kwargs = cast_inputs(self.input_dtype, args, kwargs)
        self.open_scope()
        try:
            tensors = {real: self[name] for name, real in root}
            tensors.update(self.buffers)
            if method is not None:
                with torch.nn.utils.stateless._reparametrize_module(model, tensors, tie_weights=False, strict=False):
                    return getattr(model, method)(*args, **kwargs)
            return functional_call(model, tensors, args, kwargs, tie_weights=False, strict=False)
        except torch._dynamo.exc.TorchDynamoException as e:
            if compiled.is_wrapped(model) and self.running is None:
                raise compiled.cannot_compile("the model", e, "zfunc gathers each unit outside the compiled code, "
                                              "so a compiled model breaks its graph at every unit (fullgraph=True "
                                              "cannot hold); compile the blocks instead: zf.compile_units(model, "
                                              "fullgraph=True) before step.init") from e
            raise compiled.cannot_compile(f"unit {self.running or '<root>'!r}", e) from e
        finally:
            self.close_scope()
            for h in handles:
                h()

    def hook_units(self, model: nn.Module) -> tuple[tuple, list[Callable[[], None]]]:
        """Make each unit's module fill its parameter slots from this view as it runs: the root
        unit's ``(name, real name)`` pairs, and what detaches the hooks (a compiled block stays
        attached until ``restore_models``). The model is checked once per view."""
        if id(model) not in self._checked:
            self.spec.check_model(model)
            self._checked.add(id(model))
            # a model that kept its parameters (init(free_model=False)) gets stand-ins
            # until the step is over, so every read of a weight sees the state's value
            self._own_params += lazy.install_stand_ins(model, self.spec.canonical_name)
        root, sites = _sites(model, self.spec)
        handles = []
        for name, module, slots in sites:
            if compiled.is_wrapped(model) and not compiled.is_compiled(module):
                compiled.compile_like(model, module)  # once: the unit keeps its compiled code
            if compiled.is_compiled(module):
                # a compiled block stays attached for the whole step: an activation checkpoint
                # recomputing it in backward must not show dynamo the stand-ins (another graph)
                if id(module) not in self._wrapped:
                    fill = _UnitSlots(self, name, slots)
                    self._wrapped[id(module)] = fill.hook(module) if compiled.is_wrapped(module) else fill.wrap(module)
            else:
                handles.append(_UnitSlots(self, name, slots).hook(module))
        if self.recompute is not None and torch.is_grad_enabled():
            try:  # until restore_models: a checkpoint of the user's around a unit recomputes it through this
                recompute_units.wrap(sites, self.recompute, self._recomputed)
            except BaseException:
                for h in handles:
                    h()
                raise
        return root, handles


_SITES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _sites(model: nn.Module, spec: ModelSpec):
    """The root unit's parameters ``(name, the name functional_call reaches it by)``, and each
    other unit's module with its parameter slots ``(name, owner, attr)``: looked up once per
    model and layout, not at every forward."""
    cached = _SITES.get(model)
    if cached is None or cached[0] is not spec:
        root, sites = (), []
        modules = compiled.modules_by_path(model)
        for unit in spec.units:
            if unit.name == "":
                root = tuple((name, compiled.real_name(model, name)) for name in unit.located)
                continue
            slots = []
            for name in unit.located:
                owner, _, attr = name.rpartition(".")
                slots.append((name, compiled.owner(model, owner), attr))
            sites.append((unit.name, modules[unit.name], tuple(slots)))
        cached = _SITES[model] = (spec, root, tuple(sites))
    return cached[1], cached[2]


class _UnitSlots:
    """Puts a unit's materialized tensors into its modules before the unit's module runs, and
    takes them out after: forward hooks, or for a module compiled in place (``module.compile()``)
    a call around its compiled code, so the gather stays outside the graph (zfunc.compiled)."""

    def __init__(self, view: ParamView, name: str, slots: tuple):
        self.view = view
        self.name = name  # the unit's module path, for errors
        self.slots = slots
        self.saved: list[list] = []

    def hook(self, module: nn.Module) -> Callable[[], None]:
        """Attach as forward hooks; returns what detaches."""
        pre = module.register_forward_pre_hook(self.enter)
        post = module.register_forward_hook(self.exit, always_call=True)
        return lambda: (pre.remove(), post.remove())

    def wrap(self, module: nn.Module) -> Callable[[], None]:
        """Attach around a module's compiled code (``module.compile()``), for the whole step:
        an activation checkpoint's recomputation in backward calls it too, and gets the unit from
        the step's Tracker (dynamo never sees a stand-in). Returns what detaches."""
        inner = module._compiled_call_impl

        @compiled.eager
        def around(*args, **kwargs):
            self.enter(module, args)
            output = None
            try:
                output = inner(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                raise compiled.cannot_compile(f"unit {self.name!r}", e) from e
            finally:
                self.exit(module, args, output)
            return output

        module._compiled_call_impl = around
        return lambda: setattr(module, "_compiled_call_impl", inner)

    @compiled.eager
    def enter(self, module, args):
        resolver = lazy.current()
        forward = resolver is self.view  # else backward recomputing (the Tracker), or outside a step
        if forward:
            self.view.open_scope()
            self.view.running = self.name
        old = []
        self.saved.append((forward, old))  # first: if materializing fails, exit restores what was replaced
        if resolver is None:
            return  # the stand-ins stay, and say how to run the model
        for name, mod, attr in self.slots:
            value = self.view[name] if forward else resolver.resolve(name)
            old.append(mod._parameters[attr])
            mod._parameters[attr] = value

    @compiled.eager
    def exit(self, module, args, output):
        forward, old = self.saved.pop()
        for (_, mod, attr), prev in zip(self.slots, old):
            mod._parameters[attr] = prev
        if forward:
            self.view.close_scope()
            if output is not None:  # it ran to the end (an exception leaves its name for the error)
                self.view.running = None


def apply(model: nn.Module, params: Mapping[str, torch.Tensor], *args, **kwargs) -> Any:
    """Run ``model(*args, **kwargs)`` on ``params`` instead of its own parameters.

    ``params`` is keyed like ``model.named_parameters()``; tied weights need
    only their first name. Buffers come from ``params`` if present, else from
    the model.
    """
    if isinstance(params, ParamView):
        return params.run(model, args, kwargs)
    dtype = getattr(params, "input_dtype", None)  # zf.jit's views under mixed precision, as ParamView
    if dtype is not None:
        args, kwargs = cast_inputs(dtype, args, kwargs)
    return functional_call(model, dict(params), args, kwargs, strict=False)


def apply_method(model: nn.Module, params: Mapping[str, torch.Tensor], method: str, args: tuple,
                 kwargs: dict) -> Any:
    """``model.<method>(*args, **kwargs)`` on ``params``, as ``apply`` runs its forward."""
    if isinstance(params, ParamView):
        return params.run(model, args, kwargs, method=method)
    with torch.nn.utils.stateless._reparametrize_module(model, dict(params), strict=False):
        return getattr(model, method)(*args, **kwargs)


def cast_inputs(dtype: torch.dtype, args, kwargs):
    """Floating-point inputs in the compute dtype (FSDP2's ``cast_forward_inputs``)."""
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tree_map(cast, (tuple(args), dict(kwargs)))


def loss_and_aux(out, has_aux: bool):
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("with has_aux=True, loss_fn must return a pair (loss, aux)")
        loss, aux = out
    else:
        if isinstance(out, tuple):
            raise TypeError("loss_fn returned a tuple; pass has_aux=True if it returns (loss, aux)")
        loss, aux = out, None
    return scalar_loss(loss, "loss_fn must return"), aux


def scalar_loss(loss, what: str, hint: str = "", error: type = TypeError) -> torch.Tensor:
    """``loss`` as a 0-d tensor; else ``error``, saying ``what`` takes one (then ``hint``)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    raise error(f"{what} a scalar loss tensor, a single number, got {got}{hint}")


def _describe(batch) -> str:
    leaves, _ = tree_flatten(batch)
    return ", ".join(
        f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else type(x).__name__
        for x in leaves
    )


# Messages of errors that mean the batch does not fit the model.
_SHAPE_ERROR = re.compile(
    r"size mismatch|shapes? .*(cannot|must|mismatch|invalid)|must match the size|"
    r"Sizes of tensors must match|size of tensor a|normalized_shape|Expected .*(size|dim|shape|input)|"
    r"dimension out of range|index out of range|out of bounds|expected scalar type|"
    r"expected .*dtype|mat\d and mat\d|input type|channels",
    re.IGNORECASE,
)


def _call(loss_fn, params, batch):
    """``loss_fn(params, batch)``, naming the batch when the error is a shape or index error.

    Any other error (out of memory, a failed collective, a bug in the model)
    goes up unchanged; a failed collective gets a note that another rank
    probably failed first.
    """
    try:
        return loss_fn(params, batch)
    except torch.distributed.DistError as e:
        e.add_note("A collective failed while loss_fn ran: another rank probably failed first; its error says why.")
        raise
    except (RuntimeError, ValueError, IndexError) as e:
        if isinstance(e, torch.OutOfMemoryError) or not (isinstance(e, IndexError) or _SHAPE_ERROR.search(str(e))):
            raise
        raise type(e)(
            f"loss_fn failed on a batch of [{_describe(batch)}]: {e}\n"
            "Check that the batch matches what the model expects (shapes, dtypes, index ranges)."
        ) from e


def grad_spec(spec: ParamsSpec) -> ParamsSpec:
    """The spec of gradients of ``spec``'s parameters in their home form (which leaves are shards)."""
    sharded = tuple(grad_is_shard(p, s) for s, p in zip(spec.sharded, spec.placements))
    return ParamsSpec(spec.model, spec.placements, sharded, spec.frozen, spec.group, spec.swap)


@contextlib.contextmanager
def materialized(params: Params, frozen: Params | None, buffers: Mapping, *, differentiable: bool,
                 recompute: recompute_units.Policy | None = None):
    """The set-up every step shares: units of ``params`` (and ``frozen``) ready to
    materialize on access, the ``ParamView`` handed to ``loss_fn``, its tracker. ``recompute``:
    the units ``zf.recompute`` runs under activation checkpointing."""
    tracker = Tracker()
    coordinator = coordination.current()
    tracker.run = None if coordinator is None else coordinator.begin(params.spec.model)
    trainable = Materializer(params, tracker, differentiable=differentiable)
    frozen_units = Materializer(frozen, tracker, kind="f") if frozen is not None else None
    view = ParamView(params.spec.model, trainable, frozen_units, buffers or {}, recompute)
    if tracker.run is not None:
        tracker.run.start()
    abandon = False
    try:
        yield view, tracker, trainable.anchors
        if tracker.run is not None:
            tracker.prefetch = (tracker.run.finish(),)  # only a pass that completed records its order
    except (dist.CollectiveTimeout, torch.distributed.DistError):
        abandon = True  # the collectives still in flight will not complete either
        raise
    finally:
        view.close()
        view.restore_models()
        tracker.close(abandon)


def forward(loss_fn: Callable, view: ParamView, tracker: Tracker, batch):
    """``loss_fn(view, batch)`` with stand-ins resolving through ``view`` and
    saved views of gathered buffers swapped for handles."""
    try:
        with lazy.resolving(view), tracker.hooks():
            return _call(loss_fn, view, batch)
    finally:
        view.close()


class GradOut(NamedTuple):
    """What the gradient part of a step returns."""

    loss: torch.Tensor  # this rank's loss, detached
    aux: Any
    grads: Params  # in the home representation; None for a unit no rank on this one used
    peak: int  # most bytes of gathered units alive at once
    grad_scale: float = 1.0  # the true gradients are grads times this (1/loss scale, 1/micro-batches)
    prefetch: tuple = ()  # the coordinator's metrics of each pass (zfunc.coordinator)
    # unit -> whether each of its parameters got a gradient on this rank (``merge_live``): True, False,
    # or None where zf.jit cannot tell (zfunc.traced); None for the whole: not known, every
    # parameter of a unit with a gradient counts
    live: dict[int, tuple[bool | None, ...]] | None = None


_ORDER = {False: 0, None: 1, True: 2}  # one pass's True wins over another's cannot-tell, which wins over False


def merge_live(*records) -> dict[int, tuple[bool | None, ...]] | None:
    """Which parameters of each unit got a gradient in any of ``records`` (``GradOut.live``, a
    ``Tracker``'s, one per pass or micro-batch); None if any is not known."""
    if any(r is None for r in records):
        return None
    out: dict[int, tuple[bool | None, ...]] = {}
    for record in records:
        for unit, got in record.items():
            seen = out.get(unit)
            out[unit] = tuple(got) if seen is None else tuple(max(a, b, key=_ORDER.get) for a, b in zip(seen, got))
    return out


def value_and_grad_with_stats(loss_fn: Callable, has_aux: bool = False,
                              recompute: recompute_units.Policy | None = None):
    """``value_and_grad`` that also returns the peak bytes of units materialized at once.

    A unit this rank did not use gets a ``None`` gradient (the caller decides
    with the other ranks whether anyone used it). ``recompute``: the units whose
    activations backward recomputes (``zf.recompute``).
    """

    def run(params, batch, *, frozen: Params | None = None, buffers: Mapping | None = None, scale=None, sink=None):
        """``scale`` multiplies the loss before backward (fp16 loss scaling);
        ``sink`` (zfunc.transforms.sinks) takes each unit's gradient instead of autograd."""
        if not isinstance(params, Params):
            return GradOut(*_plain_value_and_grad(loss_fn, has_aux, params, batch), 0)
        with materialized(params, frozen, buffers, differentiable=True, recompute=recompute) as (view, tracker, anchors):
            tracker.sink = sink
            loss, aux = loss_and_aux(forward(loss_fn, view, tracker, batch), has_aux)
            with lazy.resolving(tracker):
                grads = torch.autograd.grad(loss if scale is None else loss * scale, anchors, allow_unused=True)
            tracker.finish()
            peak = tracker.peak
        return GradOut(loss.detach(), aux, Params(grad_spec(params.spec), grads), peak,
                       1.0 if scale is None else 1.0 / scale, tracker.prefetch, tracker.got)

    return run


def zeros_for_unused(grads: Params) -> Params:
    """``grads`` with zeros where a unit got no gradient (research steps, which keep every leaf)."""
    spec = grads.spec
    w = dist.world_size(spec.process_group)
    leaves = [
        g if g is not None else torch.zeros(
            layout.home_numel(spec.segment(i).padded, w, spec.sharded[i]),
            dtype=spec.placements[i].param_dtype or spec.segment(i).dtype, device=_device(grads))
        for i, g in enumerate(grads.leaves)
    ]
    return Params(spec, leaves)


def _device(grads: Params) -> torch.device:
    return next((g.device for g in grads.leaves if g is not None), torch.device("cpu"))


def _plain_value_and_grad(loss_fn, has_aux, params, batch):
    leaves, treedef = tree_flatten(params)
    leaves = [t.detach().requires_grad_() for t in leaves]
    loss, aux = loss_and_aux(_call(loss_fn, tree_unflatten(treedef, leaves), batch), has_aux)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
    return loss.detach(), aux, tree_unflatten(treedef, grads)


def value_and_grad(loss_fn: Callable, has_aux: bool = False):
    """``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``) to ``(params, batch) -> (value, grads)``.

    ``params`` is a pytree of tensors or a zfunc ``Params`` (``state.params``);
    gradients come back in the same representation (sharded leaves give
    sharded gradients, averaged over ranks). ``value`` is this rank's loss;
    with ``has_aux`` it is ``(loss, aux)``. Keyword ``frozen=`` and
    ``buffers=`` pass the state's frozen parameters and buffers.
    """
    inner = value_and_grad_with_stats(loss_fn, has_aux)
    coordinator = coordination.Coordinator(coordination.Prefetch())  # its traces persist across calls

    def run(params, batch, **kw):
        with coordination.active(coordinator):
            loss, aux, grads, *_ = inner(params, batch, **kw)
        if isinstance(grads, Params):
            grads = zeros_for_unused(grads)
        return ((loss, aux) if has_aux else loss), grads

    return run


def grad(loss_fn: Callable, has_aux: bool = False):
    """Like ``value_and_grad`` but returns only the gradients (and aux with ``has_aux``)."""
    inner = value_and_grad(loss_fn, has_aux)

    def run(params, batch, **kw):
        value, grads = inner(params, batch, **kw)
        return (grads, value[1]) if has_aux else grads

    return run
