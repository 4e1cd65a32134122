"""Functions run on every rank by the worker group, and their single-process references."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch._dynamo.utils import counters

import zfunc as zf
from zfunc.testing import memory
from models import batch, build, local, loss

LR = 1e-3


def is_linear(name: str, module: nn.Module) -> bool:
    """A unit policy: every nn.Linear is a unit."""
    return isinstance(module, nn.Linear)


def compose(stage: int, loss_fn, units=None, threshold: int = 0, clip: float | None = None,
            units_via: str = "zero3", evaluate: bool = False, precision: dict | None = None,
            micro: int | None = None, precision_outside: bool = False, opt=None, offload: dict | None = None,
            prefetch: dict | None = None):
    """The step for ``stage``; ``units_via`` says where the unit policy is given:
    ``zero3(units=)``, ``train_step(units=)``, or ``zf.units`` inside or outside the stage.
    ``precision``: ``zf.mixed_precision``'s keywords; ``micro``: ``zf.accumulate``'s n,
    inside ``mixed_precision`` unless ``precision_outside`` is False (then outside);
    ``offload``: ``{"kind": "cpu" | "nvme", **keywords}``, outside both, inside the stage
    (``"under_accumulate": True``: inside ``accumulate``, which then goes outside precision);
    ``prefetch``: zero3's coordinator keywords (``prefetch_bucket_size``, ``max_live_parameters``)."""
    if evaluate:
        base = zf.eval_step(loss_fn, units=units if units_via == "base" else None)
    else:
        opt = opt or zf.optim.adamw(LR, weight_decay=0.01)
        if clip is not None:
            opt = zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt)
        base = zf.train_step(loss_fn, opt, units=units if units_via == "base" else None)
    step = zf.units(base, units) if units_via == "inner" else base
    kw = dict(offload or {})
    under_accumulate = kw.pop("under_accumulate", False)  # accumulate(offload_*(...)) instead
    if micro is not None and not precision_outside and not under_accumulate:
        step = zf.accumulate(step, micro)
    if precision is not None:
        step = zf.mixed_precision(step, **precision)
    if offload is not None and under_accumulate:
        step = getattr(zf, "offload_" + kw.pop("kind"))(step, **kw)
    if micro is not None and (precision_outside or under_accumulate):
        step = zf.accumulate(step, micro)
    if offload is not None and not under_accumulate:
        step = getattr(zf, "offload_" + kw.pop("kind"))(step, **kw)
    if stage == 1:
        step = zf.zero1(step)
    elif stage == 2:
        step = zf.zero2(step)
    elif stage == 3:
        step = zf.zero3(step, units=units if units_via == "zero3" else None, persistence_threshold=threshold,
                        **(prefetch or {}))
    return zf.units(step, units) if units_via == "outer" else step


def _setup(name: str, kw: dict, seed: int):
    """This rank, the world size, the model, an untouched twin (for batch shapes), its loss."""
    model = build(name, seed, **kw)
    return zf.dist.rank(), zf.dist.world_size(), model, copy.deepcopy(model), _setup_loss(name, model)


def _setup_loss(name: str, model):
    def loss_fn(params, b):
        x, y = b
        return loss(name, zf.apply(model, params, x), y)

    return loss_fn


def seeded_init(module) -> None:
    """An init that depends only on the module's shapes, so eager and meta-device init agree."""
    g = torch.Generator().manual_seed(sum(p.numel() for p in module.parameters(recurse=False)) + 7)
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for b in module.buffers(recurse=False):
            b.copy_(torch.rand(b.shape, generator=g) if b.is_floating_point() else torch.zeros_like(b))


def run_zfunc(name: str, kw: dict, stage: int, steps: int = 3, per_rank: int = 2, seed: int = 0,
              units=None, threshold: int = 0, clip: float | None = None, units_via: str = "zero3",
              free_model: bool = True, skips=None, meta: bool = False, prefetch: dict | None = None) -> dict:
    """``steps`` zfunc steps on this rank's part of each global batch.

    ``skips[i]``: the block the ``skipping`` model leaves out at step ``i``.
    ``meta``: build the model on the meta device and init it unit by unit.
    ``prefetch``: zero3's coordinator keywords; ``result["prefetch"]`` has each step's metrics.
    """
    rank, world, model, shape_model, loss_fn = _setup(name, kw, seed)
    if meta:
        with torch.device("meta"):
            model = build(name, seed, **kw)
        loss_fn = _setup_loss(name, model)
    step = compose(stage, loss_fn, units, threshold, clip, units_via, prefetch=prefetch)
    state = step.init(model, free_model=free_model, init_fn=seeded_init if meta else None)
    losses, grad_bytes, peak, prefetched = [], [], [], []
    for i in range(steps):
        if skips is not None:
            model.skip = skips[i]
        b = local(batch(name, shape_model, i, per_rank * world, seed), rank, world)
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
        grad_bytes.append(metrics["grad_bytes"])
        peak.append(metrics["peak_materialized_bytes"])
        prefetched.append(metrics["prefetch"])
    evaluate = compose(stage, loss_fn, units, threshold, units_via=units_via, evaluate=True)
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
        "prefetch": prefetched,
        "losses": losses,
        "eval_loss": eval_loss,
        "units": [(u.name, u.trainable.numel, u.trainable.padded) for u in state.params.spec.model.units],
    }


def init_state(name: str, stage: int, meta: bool) -> dict:
    """The initial state's full parameters and buffers, from an eager model given
    ``seeded_init`` or from the meta device initialized unit by unit with it."""
    if meta:
        with torch.device("meta"):
            model = build(name)
    else:
        model = build(name)
        for m in model.modules():
            seeded_init(m)
    state = compose(stage, _setup_loss(name, model)).init(model, init_fn=seeded_init if meta else None)
    return {"params": zf.gather_params(state), "buffers": dict(state.buffers)}


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


def reference(name: str, kw: dict, steps: int = 3, batch_size: int = 2, seed: int = 0, clip: float | None = None,
              skips=None, meta: bool = False, device: str = "cpu") -> dict:
    """Plain PyTorch: one process, torch.optim.AdamW with its defaults, the global batch
    (on ``device``; the result on the CPU)."""
    model = build(name, seed, **kw)
    if meta:
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                seeded_init(m)
    model.to(device)
    losses = train_plain(name, model, steps, batch_size, seed, clip, skips=skips, device=device)
    x, y = batch(name, model, steps, batch_size, seed, device)
    with torch.no_grad():
        eval_loss = loss(name, model(x), y).item()
    return {"params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()}, "losses": losses,
            "eval_loss": eval_loss, "buffers": {k: v.cpu() for k, v in model.named_buffers()}}


def train_plain(name: str, model, steps: int, batch_size: int, seed: int, clip: float | None = None, skips=None,
                device: str = "cpu", shape_model=None) -> list[float]:
    """``steps`` steps of torch.optim.AdamW (its defaults, weight decay 0.01) on ``model`` over the
    global batches (shaped by ``shape_model``, default ``model``), clipped at ``clip``; the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    losses = []
    for i in range(steps):
        if skips is not None:
            model.skip = skips[i]
        x, y = batch(name, shape_model or model, i, batch_size, seed, device)
        opt.zero_grad()
        value = loss(name, model(x), y)
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(value.item())
    return losses


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


def meta_init_peak(units: int, width: int) -> dict:
    """Bytes of RSS above the pre-model baseline at the peak of a zero3 meta-device init
    (the high-water mark, reset just before init: zfunc.testing.memory)."""

    class Wide(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    step = zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1)))
    with torch.device("meta"):
        step.init(Wide(2))  # loads the code paths once
    before = memory.rss()
    memory.reset_peak()
    with torch.device("meta"):
        model = Wide(units)
    state = step.init(model)
    peak = memory.peak() - before
    full = sum(u.trainable.padded for u in state.params.spec.model.units) * 4
    return {"peak": peak, "full": full, "held": state.params.nbytes(), "unit": 4 * (width * width + width)}


def zero3_step_peak(blocks: int, width: int, steps: int, large_blocks: bool) -> dict:
    """RSS a zero3 step needs above the state (meta-device init, so no eager model):
    the peak over ``steps`` steps, and what stays resident after them, both above the
    RSS right after init. ``large_blocks=False`` keeps torch's allocator (this
    process only: it is a fresh one)."""
    import os

    if not large_blocks:
        os.environ["ZFUNC_CPU_ALLOCATOR"] = "0"

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    with torch.device("meta"):
        model = Deep()
    step = zf.zero3(zf.train_step(lambda p, b: zf.apply(model, p, b).square().mean(), zf.optim.adamw(1e-3)))
    state = step.init(model)
    g = torch.Generator().manual_seed(zf.dist.rank())
    after_init = memory.rss()
    memory.reset_peak()
    for _ in range(steps):
        state, _m = step(state, torch.randn(4, width, generator=g))
    return {"peak": memory.peak() - after_init, "resident": memory.rss() - after_init, "state": state.params.nbytes(),
            "unit": 4 * (width * width + width), "large_blocks": zf.ops.large_blocks.installed()}


def nonfinite_on_rank0(stage: int) -> str:
    """A NaN in rank 0's batch only: every rank must raise, none may train on."""
    rank, world, model, shape_model, loss_fn = _setup("odd_mlp", {}, 0)
    step = compose(stage, loss_fn)
    state = step.init(model)
    x, y = local(batch("odd_mlp", shape_model, 0, 2 * world), rank, world)
    if rank == 0:
        x = x.clone()
        x[0, 0] = float("nan")
    try:
        step(state, (x, y))
    except FloatingPointError as e:
        return str(e)
    return "trained on"


def loss_with_uneven_batches(stage: int) -> dict:
    """Rank r passes r + 1 examples: the loss metric is the mean of the ranks' losses."""
    rank, world, model, shape_model, loss_fn = _setup("odd_mlp", {}, 0)
    step = compose(stage, loss_fn)
    state = step.init(model)
    x, y = batch("odd_mlp", shape_model, 0, rank + 1)
    own = loss_fn(zf.gather_params(state), (x, y)).item()
    _, metrics = step(state, (x, y))
    return {"own": own, "metric": metrics["loss"].item()}


def micro_batches(b, n: int) -> list:
    """``b`` split into ``n`` equal micro-batches along the batch dimension."""
    size = b[0].shape[0] // n
    return [tuple(t[i * size : (i + 1) * size] for t in b) for i in range(n)]


def run_composed(name: str, kw: dict, stage: int, steps: int = 3, per_rank: int = 4, seed: int = 0,
                 precision: dict | None = None, micro: int | None = None, clip: float | None = None,
                 precision_outside: bool = False, units=None, sgd: bool = False, inject=None,
                 offload: dict | None = None, compile: dict | None = None, device: str = "cpu",
                 peek: bool = True) -> dict:
    """``steps`` steps of ``zeroN([accumulate][mixed_precision](train_step))`` on this rank's
    part of each global batch (split into ``micro`` micro-batches); per-step metrics, the
    full parameters (the fp32 master under mixed precision) and memory accounting.

    ``sgd``: SGD instead of AdamW (a dict: its momentum and decay keywords).
    ``inject[i]``: the ranks whose gradient gets an inf at step ``i`` (through the loss).
    ``compile``: ``{"how": "blocks" | "wrapped" | "model" | "jit", **torch.compile keywords}``
    (``compiled`` below); ``result["graphs"]``: dynamo's unique graphs after each step.
    ``device``: where the model and batches live (``"cuda"`` under a nccl group); the
    result comes back on the CPU. ``peek``: read the state between steps (``history[i]["unchanged"]``);
    False leaves it alone, so an update behind the next forward (``offload_cpu(overlap=True)``) runs
    there."""
    rank, world, model, shape_model, _ = _setup(name, kw, seed)
    model.to(device)
    compiled_model = model if compile is None else compiled(model, compile)
    flags = torch.zeros(())

    def loss_fn(params, b):
        value = loss(name, zf.apply(compiled_model, params, b[0]), b[1])
        return _InfInGrad.apply(value, flags) if inject is not None else value

    opt = zf.optim.sgd(LR * 10, **_sgd_keywords(sgd)) if sgd else None
    step = compose(stage, loss_fn, units, 0, clip, precision=precision, micro=micro,
                   precision_outside=precision_outside, opt=opt, offload=offload)
    if compile is not None and compile["how"] == "jit":
        step = zf.jit(step, **{k: v for k, v in compile.items() if k != "how"})
    state = step.init(compiled_model, device=None if device == "cpu" else device)  # gloo on a GPU: states there too
    history, graphs = [], []
    for i in range(steps):
        flags.fill_(float(inject is not None and rank in inject[i]))
        b = local(batch(name, shape_model, i, per_rank * world, seed, device), rank, world)
        if peek:
            before = [zf.swap.load(t).clone() for t in zf.pytree.tree_leaves((state.params, state.opt_state))]
        state, metrics = step(state, micro_batches(b, micro) if micro else b)
        if peek:
            after = [zf.swap.load(t) for t in zf.pytree.tree_leaves((state.params, state.opt_state))]
            metrics = metrics | {"unchanged": all(torch.equal(x, y) for x, y in zip(before, after))}
        history.append({k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()})
        graphs.append(counters["stats"]["unique_graphs"])
    with state:  # removes swap files (offload_nvme) when done
        return {
            "graphs": graphs,
            "devices": sorted({str(t.device) for t in state.params.leaves}),
            "params": zf.gather_params(state),  # on the CPU
            "dtypes": sorted({str(t.dtype) for t in state.params.leaves}),
            "memory": zf.memory_report(state),
            "units": [(u.name, u.trainable.numel, u.trainable.padded) for u in state.params.spec.model.units],
            "history": history,
            "composition": step.composition,
        }


def _sgd_keywords(sgd) -> dict:
    """``sgd``: True (plain SGD) or the momentum and decay keywords both SGDs take."""
    return sgd if isinstance(sgd, dict) else {}


def compiled(model: nn.Module, how: dict) -> nn.Module:
    """``model`` compiled as ``how["how"]`` says, with the rest of ``how`` as torch.compile's keywords
    (dynamo's caches and counters reset first, as the worker processes outlive a test):
    ``blocks`` each unit's module in place (zf.compile_units), ``wrapped`` each ModuleList child
    replaced by ``torch.compile(child)``, ``model`` the whole model wrapped, ``jit`` as it is
    (``run_composed`` compiles the step)."""
    torch._dynamo.reset()
    counters.clear()
    kw = {k: v for k, v in how.items() if k != "how"}
    if how["how"] == "blocks":
        return zf.compile_units(model, **kw)
    if how["how"] == "wrapped":
        for blocks in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
            for i, block in enumerate(list(blocks)):
                blocks[i] = torch.compile(block, **kw)
        return model
    if how["how"] == "model":
        return torch.compile(model, **kw)
    return model


class _InfInGrad(torch.autograd.Function):
    """Identity on the loss; its backward puts an inf into the gradient when ``flag`` is set."""

    @staticmethod
    def forward(value, flag):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.flag = bool(inputs[1])

    @staticmethod
    def backward(ctx, g):
        return (g * float("inf") if ctx.flag else g), None


def reference_mixed(name: str, kw: dict, dtype, steps: int = 3, batch_size: int = 4, seed: int = 0,
                    loss_scale: float = 1.0, clip: float | None = None, sgd: bool = False, device: str = "cpu") -> dict:
    """Plain PyTorch mixed precision: a module copy cast to ``dtype`` runs forward and
    backward on the global batch (loss times ``loss_scale``), and fp32 AdamW (or SGD, with
    ``sgd``'s keywords if a dict) updates a master copy, which is cast back into the copy
    (on ``device``; the result on the CPU)."""
    master = build(name, seed, **kw).to(device)
    low = copy.deepcopy(master).to(dtype)
    params = [p for p in master.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(params, lr=LR * 10, **_sgd_keywords(sgd)) if sgd
           else torch.optim.AdamW(params, lr=LR, weight_decay=0.01))
    losses = []
    for i in range(steps):
        x, y = batch(name, master, i, batch_size, seed, device)
        low.zero_grad(set_to_none=True)
        value = loss(name, low(x.to(dtype) if x.is_floating_point() else x), y)
        (value * loss_scale).backward()
        for mp, lp in zip(master.parameters(), low.parameters()):
            mp.grad = None if lp.grad is None else lp.grad.float() / loss_scale
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        with torch.no_grad():
            for mp, lp in zip(master.parameters(), low.parameters()):
                lp.copy_(mp)
        losses.append(value.item())
    return {"params": {k: v.detach().cpu().clone() for k, v in master.named_parameters()}, "losses": losses}
