"""A state's weights streamed out unit by unit, in buckets: what an inference engine takes after
each update in reinforcement-learning post-training (vLLM's ``load_weights`` takes an iterable
of ``(name, tensor)``), with no file and no whole-model gather.

``iter_weights(state)`` yields the tensors ``save_hf`` writes, under the same names and in the
same dtypes (each parameter once under its first name, tied weights once; persistent buffers;
the fp32 master weights under mixed precision), equal to ``zf.gather_params(state)`` cast to
them. Every rank calls it and runs through it, since each unit is all-gathered as it is
reached. Units are gathered until a bucket of ``bucket_bytes`` is full, and only then is the
bucket handed out: every rank's collectives for a bucket are over before any rank's consumer
sees it, so a consumer that is slow, or that runs collectives of its own (a broadcast to an
inference engine) on one rank, never leaves another rank waiting inside a gather. What is held
at once is a bucket and the unit being gathered, whatever the model's size.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterator

import torch

from .. import dist
from ..state import check_usable, master_params, unit_values
from . import peft_export
from .hf_files import Planned

DEFAULT_BUCKET_BYTES = 256 * 2**20  # a few units of a 7B model; verl streams 2 GB, vLLM's own loaders less


def named_values(state, dtype: torch.dtype | None, device) -> tuple[list[Planned], Counter, Iterator]:
    """``(plan, parameter elements per dtype, values)`` of ``state`` as ``save_hf`` writes it: ``plan``
    every tensor to come (name, shape, dtype), in order; ``values`` yields ``(name, tensor on
    device)``, gathering one unit at a time (every rank runs through it) and handing each tensor
    over so that the unit is freed once its last is taken."""
    spec = state.params.spec
    transient = set(spec.model.transient_buffers)
    buffers = {n: b for n, b in state.buffers.items() if n not in transient}
    trainable = master_params(state)
    pieces = [(params, i) for i in range(len(spec.model.units)) for params in (trainable, state.frozen)]
    segments = [([(e.name, e.shape) for e in params.spec.segment(i).entries], params.spec.segment(i).dtype)
                for params, i in pieces]
    plan, parameters = plan_tensors(segments, [(n, tuple(b.shape), b.dtype) for n, b in buffers.items()], dtype)
    dtypes = {t.name: t.dtype for t in plan}

    def values():
        for params, i in pieces:
            if params.spec.segment(i).entries:
                views = params.spec.segment(i).unflatten(unit_values(params, i))
                for name in list(views):
                    yield name, views.pop(name).to(device, dtypes[name])
        for name, b in buffers.items():
            yield name, b.to(device, dtypes[name])

    return plan, parameters, values()


def plan_tensors(segments, buffers, dtype) -> tuple[list[Planned], Counter]:
    """Every tensor to write, in the order they come (unit by unit, each unit's trainable then frozen
    parameters, then the buffers), and how many parameter elements are written in each dtype.

    ``segments``: ``[([(name, shape)], the model's dtype)]``; ``buffers``: ``[(name, shape, dtype)]``.
    ``dtype``: what every floating-point tensor is cast to, or None for the model's own."""
    plan, parameters = [], Counter()
    for entries, model_dtype in segments:
        for name, shape in entries:
            t = Planned(name, tuple(shape), model_dtype if dtype is None or not model_dtype.is_floating_point
                        else dtype)
            plan.append(t)
            parameters[t.dtype] += math.prod(t.shape)
    for name, shape, b_dtype in buffers:
        plan.append(Planned(name, shape, dtype if dtype is not None and b_dtype.is_floating_point else b_dtype))
    return plan, parameters


def iter_weights(state, *, dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 names: str = "hf", device=None, buckets: bool = False, model=None, merged: bool = True,
                 adapter: str | None = None):
    """Yield ``(name, tensor)`` for every weight of ``state`` (see the module docstring), every rank.

    ``dtype``: every floating-point tensor cast to it (``torch.bfloat16`` for an inference
    engine); None keeps the model's own. ``bucket_bytes``: how much is gathered before it is
    handed out (a tensor larger than it is a bucket of its own). ``names``: ``"hf"``, the model's
    own names as ``save_hf`` writes them. ``device``: where the tensors are handed out; None:
    where the state computes (the GPU its ``step.init`` put it on, for an IPC or NCCL hand-off,
    with or without a process group; the CPU for a CPU state). ``buckets``: yield each bucket as a
    list of ``(name, tensor)`` instead, for a
    consumer that packs them.

    A peft model's state (``model=``: the ``PeftModel`` ``step.init`` took): with ``merged=True``
    the weights of its ``merge_and_unload()`` under the base model's names (an inference engine
    running the base architecture), else the tensors of ``adapter`` (the active one by default)
    as ``PeftModel.save_pretrained`` names them (an engine that serves LoRA adapters); what
    ``save_hf(..., model=, merged=)`` writes."""
    if names != "hf":
        raise ValueError(f"iter_weights(names={names!r}): only names='hf' (the model's own names, as save_hf "
                         "writes them) is offered")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"iter_weights(bucket_bytes={bucket_bytes!r}): give a positive whole number of bytes")
    group = state.params.spec.process_group
    sharded = any(state.params.spec.sharded) or any(state.frozen.spec.sharded)
    check_usable(state, collective=sharded)
    device = dist.compute_device(group) if device is None else torch.device(device)
    values = _peft_values(state, model, merged, adapter, dtype, device)
    if values is None:
        _, _, values = named_values(state, dtype, device)
    return _buckets(values, bucket_bytes) if buckets else _pairs(_buckets(values, bucket_bytes))


def _peft_values(state, model, merged: bool, adapter: str | None, dtype, device):
    """A peft model's merged weights or one adapter's tensors, on ``device``; None for another model."""
    if model is not None:
        state.params.spec.model.check_model(model)
    if not peft_export.is_peft(model):
        if model is None and peft_export.looks_like_peft([n for n, _ in state.params.spec.model.owner]):
            raise ValueError("iter_weights: this state is a peft model's (its names are under 'base_model.model.'), "
                             "which no engine loads as they are: pass model=, the PeftModel step.init took, for the "
                             "merged weights (merged=True) or an adapter's (merged=False)")
        if adapter is not None:
            raise ValueError("iter_weights(adapter=...) is for a peft model: pass model=, the PeftModel step.init took")
        return None
    if merged:
        if adapter is not None:
            raise ValueError("iter_weights(merged=True) merges the active adapters, as merge_and_unload() does; "
                             "adapter= streams one adapter's tensors: pass merged=False with it")
        _, _, values, _ = peft_export.merged_model(state, model, dtype)
    else:
        chosen = adapter if adapter is not None else model.active_adapter
        if not isinstance(chosen, str):
            raise ValueError(f"iter_weights(merged=False): the model has several active adapters {chosen}: name the "
                             "one to stream with adapter=")
        values = peft_export.adapter_folders(state, model, selected_adapters=[chosen], dtype=dtype)[0].values()
    return ((name, t.to(device)) for name, t in values)


def _buckets(values, bucket_bytes: int):
    bucket, size = [], 0
    for name, t in values:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _pairs(buckets):
    for bucket in buckets:
        bucket.reverse()
        while bucket:
            yield bucket.pop()  # the consumer holds the only reference once it has taken one
