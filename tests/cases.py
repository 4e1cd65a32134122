"""Functions run on every rank by the worker group, and their single-process references."""
from __future__ import annotations

import copy

import torch
from torch import nn

import zfunc as zf
from models import batch, build, local, loss

LR = 1e-3


def is_linear(name: str, module: nn.Module) -> bool:
    """A unit policy: every nn.Linear is a unit."""
    return isinstance(module, nn.Linear)


def compose(stage: int, loss_fn, units=None, threshold: int = 0, clip: float | None = None):
    opt = zf.optim.adamw(LR, weight_decay=0.01)
    if clip is not None:
        opt = zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt)
    step = zf.train_step(loss_fn, opt)
    if stage == 1:
        return zf.zero1(step)
    if stage == 2:
        return zf.zero2(step)
    if stage == 3:
        return zf.zero3(step, units=units, persistence_threshold=threshold)
    return step


def _setup(name: str, kw: dict, seed: int):
    """This rank, the world size, the model, an untouched twin (for batch shapes), its loss."""
    model = build(name, seed, **kw)

    def loss_fn(params, b):
        x, y = b
        return loss(name, zf.apply(model, params, x), y)

    return zf.dist.rank(), zf.dist.world_size(), model, copy.deepcopy(model), loss_fn


def run_zfunc(name: str, kw: dict, stage: int, steps: int = 3, per_rank: int = 2, seed: int = 0,
              units=None, threshold: int = 0, clip: float | None = None) -> dict:
    """``steps`` zfunc steps on this rank's part of each global batch."""
    rank, world, model, shape_model, loss_fn = _setup(name, kw, seed)
    step = compose(stage, loss_fn, units, threshold, clip)
    state = step.init(model)
    losses, grad_bytes, peak = [], [], []
    for i in range(steps):
        b = local(batch(name, shape_model, i, per_rank * world, seed), rank, world)
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
        grad_bytes.append(metrics["grad_bytes"])
        peak.append(metrics["peak_materialized_bytes"])
    evaluate = {0: lambda s: s, 1: zf.zero1, 2: zf.zero2, 3: lambda s: zf.zero3(s, units=units, persistence_threshold=threshold)}[stage](zf.eval_step(loss_fn))
    eval_b = local(batch(name, shape_model, steps, per_rank * world, seed), rank, world)
    # eval first: it reads the state straight out of the step, with stage 1/2
    # all-gathers still in flight, each unit waited for only when first used
    eval_loss = evaluate(state, eval_b)["loss"].item()
    return {
        "params": zf.gather_params(state),
        "buffers": {k: v.clone() for k, v in state.buffers.items()},
        "memory": zf.memory_report(state),
        "grad_bytes": grad_bytes,
        "peak": max(peak),
        "losses": losses,
        "eval_loss": eval_loss,
        "units": [(u.name, u.trainable.numel, u.trainable.padded) for u in state.params.spec.model.units],
    }


def gathers_in_flight(name: str, stage: int, per_rank: int = 2) -> dict:
    """One step; which units were still being all-gathered when it returned,
    then the leaves once flattening has waited for them."""
    rank, world, model, shape_model, loss_fn = _setup(name, {}, 0)
    step = compose(stage, loss_fn)
    state = step.init(model)
    state, _ = step(state, local(batch(name, shape_model, 0, per_rank * world, 0), rank, world))
    in_flight = sorted(state.params._filling)
    leaves = [t.clone() for t in zf.pytree.tree_leaves(state.params)]
    return {"in_flight": in_flight, "left": len(state.params._filling), "leaves": leaves}


def reference(name: str, kw: dict, steps: int = 3, batch_size: int = 2, seed: int = 0, clip: float | None = None) -> dict:
    """Plain PyTorch: one process, torch.optim.AdamW, the global batch."""
    model = build(name, seed, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    losses = []
    for i in range(steps):
        x, y = batch(name, model, i, batch_size, seed)
        opt.zero_grad()
        value = loss(name, model(x), y)
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(value.item())
    x, y = batch(name, model, steps, batch_size, seed)
    with torch.no_grad():
        eval_loss = loss(name, model(x), y).item()
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "losses": losses,
            "eval_loss": eval_loss, "buffers": dict(model.named_buffers())}


def run_ddp(name: str, kw: dict, steps: int = 3, per_rank: int = 2, seed: int = 0) -> dict:
    """torch DDP on this rank's slice: the oracle for per-rank BatchNorm statistics."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(name, seed, **kw)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for i in range(steps):
        x, y = local(batch(name, model, i, per_rank * world, seed), rank, world)
        opt.zero_grad()
        loss(name, ddp(x), y).backward()
        opt.step()
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()}}


def run_research_step(name: str, kw: dict, steps: int = 3, per_rank: int = 2, seed: int = 0) -> dict:
    """A hand-written step from value_and_grad and an optimizer, on zero3-sharded params."""
    rank, world, model, shape_model, loss_fn = _setup(name, kw, seed)
    opt = zf.optim.adamw(LR, weight_decay=0.01)
    state = zf.zero3(zf.train_step(loss_fn, opt)).init(model)
    params, opt_state = state.params, state.opt_state
    vg = zf.value_and_grad(loss_fn)
    for i in range(steps):
        b = local(batch(name, shape_model, i, per_rank * world, seed), rank, world)
        value, grads = vg(params, b, frozen=state.frozen, buffers=state.buffers)
        assert [g.shape for g in grads.leaves] == [p.shape for p in params.leaves]  # sharded like params
        params, opt_state = opt.update(grads, opt_state, params)
    return {"params": zf.gather_params(zf.State(params, opt_state, state.frozen, state.buffers, state.count, state.plan))}
