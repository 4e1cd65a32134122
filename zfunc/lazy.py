"""Stand-ins for a model's parameters once a zfunc State owns the weights.

``Step.init`` puts a ``LazyParameter`` (a meta-device ``nn.Parameter``) in
every parameter slot of the model. Whatever code touches one, inside a
module's forward, in another module's forward (``F.linear(h, self.emb.weight)``),
in ``loss_fn``, or in the recomputation of an activation checkpoint during
backward, gets the unit's materialized value: the stand-in's
``__torch_function__`` asks the active *resolver* for it.

Resolvers are pushed by zfunc while it runs a model: the forward's
``ParamView`` (which materializes the unit and counts the use) and, during
backward, the step's ``Tracker`` (which re-gathers the unit, as for saved
tensors). Outside both, using a stand-in raises an error that says how to
run the model. Shape queries never materialize anything.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from . import compiled

_resolvers: list = []  # innermost last; each has ``resolve(name) -> Tensor``

# Metadata a stand-in answers itself (the meta tensor has the right shape and dtype).
_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__hash__,
    torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.is_meta.__get__,
    # what torch.compile asks of every tensor it sees
    torch.Tensor._is_view, torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous,
    torch.Tensor.untyped_storage, torch.Tensor.element_size, torch.Tensor.is_neg, torch.Tensor.is_conj,
}


class LazyParameter(nn.Parameter):
    """A parameter slot whose value lives in a zfunc State (canonical name ``_zfunc_name``)."""

    def __new__(cls, like: torch.Tensor, name: str, requires_grad: bool):
        meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
        p = torch.Tensor._make_subclass(cls, meta, requires_grad)
        p._zfunc_name = name
        return p

    def __deepcopy__(self, memo):
        return LazyParameter(self, self._zfunc_name, self.requires_grad)

    def __reduce_ex__(self, proto):
        return (LazyParameter, (torch.empty(self.shape, dtype=self.dtype, device="meta"),
                                self._zfunc_name, self.requires_grad))

    @classmethod
    @compiled.eager  # a stand-in read inside compiled code: resolved (gathered) outside the graph
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA or _is_metadata_getter(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if not _resolvers:
            name = next(a._zfunc_name for a in _flat(args, kwargs) if isinstance(a, LazyParameter))
            raise RuntimeError(
                f"parameter {name!r} is held by a zfunc State (step.init took the model's weights): "
                "run the model as zf.apply(model, params, ...) inside loss_fn, or read the weights "
                "with zf.gather_params(state)"
            )
        resolver = _resolvers[-1]
        args, kwargs = tree_map_only(LazyParameter, lambda p: resolver.resolve(p._zfunc_name), (args, kwargs))
        return func(*args, **kwargs)


# Attribute getters that give a value (a view of the weight), not metadata.
_VALUE_GETTERS = {"T", "mT", "H", "mH", "real", "imag", "data"}


def _is_metadata_getter(func) -> bool:
    """An attribute read other than a view of the values (``is_nested``, ``device``, ...: what
    torch.compile asks of every tensor it sees) answers from the meta tensor."""
    if getattr(func, "__name__", None) != "__get__":
        return False
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", None) not in _VALUE_GETTERS


def _flat(args, kwargs):
    return torch.utils._pytree.tree_leaves((args, kwargs))


def current():
    """The resolver stand-ins read through now (the forward's ParamView, backward's Tracker), or None."""
    return _resolvers[-1] if _resolvers else None


@contextlib.contextmanager
def resolving(resolver):
    """Let stand-ins resolve through ``resolver`` inside the block."""
    _resolvers.append(resolver)
    try:
        yield
    finally:
        _resolvers.remove(resolver)


def is_lazy(p) -> bool:
    return isinstance(p, LazyParameter)


def stand_ins(model: nn.Module, canonical) -> dict[int, LazyParameter]:
    """One stand-in per distinct parameter of ``model`` (ties share one), by ``id`` of the parameter."""
    made: dict[int, LazyParameter] = {}
    for name, p in compiled.named_parameters(model, remove_duplicate=False):
        if id(p) not in made:
            made[id(p)] = LazyParameter(p, canonical(name), p.requires_grad)
    return made


def install_stand_ins(model: nn.Module, canonical) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Put stand-ins in every parameter slot; return what was there, for ``restore_parameters``."""
    made = stand_ins(model, canonical)
    old = []
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and not is_lazy(p):
                old.append((module, attr, p))
                module._parameters[attr] = made[id(p)]
    return old


def restore_parameters(old) -> None:
    """Put back the parameters ``install_stand_ins`` took out."""
    for module, attr, p in old:
        module._parameters[attr] = p
