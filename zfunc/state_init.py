"""A step's first state, built from a model (``Step.init``).

The transforms place each unit (``Step.placement``); each rank makes its shards unit by unit
(zfunc.unit_init), from rank 0's values or its own part of pretrained weights (zfunc.weights),
and hands them to the home a transform keeps them in (``Transform.init_home``: offload_nvme's
swap files); then the buffers, the optimizer state over this rank's part, the dtypes each
placement stores, and stand-ins for the model's parameters. An init that raises closes that
home, so nothing it made is left behind.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from . import compiled, dist, layout, lazy
from .buffers import use_large_blocks
from .optim.whole import whole_params
from .state import State
from .tree import Params, ParamsSpec, build_spec
from .unit_init import device_of_model, is_meta_model, unit_buffers
from .weights.pretrained import Weights


def init_state(step, model: nn.Module, *, free_model: bool, init_fn: Callable | None, device, weights,
               strict: bool) -> State:
    """``step``'s state for ``model`` (``Step.init`` says what each argument does)."""
    homes: list = []
    try:
        return _build(step, model, homes, free_model=free_model, init_fn=init_fn, device=device, weights=weights,
                      strict=strict)
    except BaseException:
        for home in homes:
            home.close()
        raise


def _build(step, model: nn.Module, homes: list, *, free_model, init_fn, device, weights, strict) -> State:
    dist.check_launch()
    use_large_blocks()  # from here on, large CPU temporaries are reused, not left in malloc's heap
    group = step.group
    w, r = dist.world_size(group), dist.rank(group)
    spec = build_spec(model, step.units, w, whole=whole_params(step.optimizer))  # owners: zfunc.optim.owners
    places = tuple(step.placement(u, spec) for u in spec.units)
    device = _device(model, device, group)
    dist.set_compute_device(group, device)  # units read from host memory or disk are computed there
    # offload_nvme: the state's swap folder; each unit's shards (frozen too) go to disk as they are made
    home = next((h for t in step.transforms if (h := t.init_home(step, spec, places, group)) is not None), None)
    homes += [] if home is None else [home]  # closed by init if anything below raises

    def part(i, segment):  # this rank's elements of a unit's flat buffer
        n = layout.home_numel(segment.padded, w, places[i].params_sharded)
        start = layout.shard_start(r, n) if places[i].params_sharded else 0
        return start, start + n

    trainable, frozen = [], []
    with contextlib.ExitStack() as files:
        read = None if weights is None else files.enter_context(Weights(weights, model, spec, strict))
        for i, *flats, whole in unit_buffers(model, spec, device, init_fn, read, part):
            for flat, out in zip(flats, (trainable, frozen)):
                leaf = flat  # read from the files: this rank's part already
                if whole:
                    dist.broadcast(flat, 0, step.agreement_group)  # every rank starts from rank 0's weights
                    leaf = layout.shard(flat, r, w).clone() if places[i].params_sharded else flat
                if home is not None:
                    leaf = home.keep(i, spec.units[i], places[i], leaf, frozen=out is frozen)
                out.append(leaf)
    sharded = tuple(p.params_sharded for p in places)
    key = dist.group_key(group)
    swap_key = None if home is None else home.key
    params = Params(ParamsSpec(spec, places, sharded, False, key, swap_key), trainable)
    frozen_params = Params(ParamsSpec(spec, places, sharded, True, key, swap_key), frozen)
    buffers = {name: b.detach().to(device, copy=True) for name, b in compiled.named_buffers(model)}
    for b in buffers.values():
        dist.broadcast(b, 0, step.agreement_group)
    # the optimizer (mixed precision: its fp32 master) starts from the model's own values,
    # then the parameters take the dtype their placement stores them in
    opt_state = step.update_part().init(params) if step.optimizer is not None else None
    if home is not None:
        home.finish()  # what the optimizer's init did not write (an eval step's init)
    params = _cast(params, [p.param_dtype for p in places])
    frozen_params = _cast(frozen_params, [p.frozen_dtype for p in places])
    for t in reversed(step.transforms):
        buffers = {name: t.cast_buffer(name, b) for name, b in buffers.items()}
    if free_model:
        lazy.install_stand_ins(model, spec.canonical_name)
    scaler = step.loss_scaler
    state = State(params, opt_state, frozen_params, buffers, torch.zeros((), dtype=torch.int64), step.plan(),
                  loss_scale=None if scaler is None else scaler.init())
    if read is not None:
        object.__setattr__(state, "loading_info", read.incompatible)
    return state


def _device(model: nn.Module, device, group) -> torch.device:
    """Where the state is made: ``device`` if given (a model built elsewhere is copied there unit by
    unit, as DeepSpeed and FSDP2 move a CPU-built model to the GPU); else a model built on an
    accelerator stays there; else the group's device (the GPU under nccl, the CPU under gloo)."""
    if device is not None:
        return torch.device(device)
    if not is_meta_model(model) and device_of_model(model).type not in ("cpu", "meta"):
        return device_of_model(model)
    return dist.device_of(group)


def _cast(params: Params, dtypes) -> Params:
    """``params`` with each leaf in its dtype (``None``: as it is)."""
    leaves = [t if d is None or t.dtype == d else t.to(d) for t, d in zip(params.leaves, dtypes)]
    return Params(params.spec, leaves)
