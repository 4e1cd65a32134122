"""zf.recompute's oracle and runs: plain PyTorch with each unit's module's forward run under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (the reference), a zfunc run of a
named composition (tests/harness/compositions.py) with or without ``zf.recompute``, and the calls of
the units' modules, which say whether backward ran them again."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zfunc as zf
from cases import LR, compose, micro_batches, train_plain
from compositions import COMPOSITIONS
from models import batch, build, local, loss

def _checkpointed_class(cls: type) -> type:
    """``cls`` whose forward runs as ``checkpoint(forward, *args, use_reentrant=False)``: a subclass,
    so names, indexing and attributes stay the model's own. The module's own hooks run once, outside
    the checkpoint, as under zf.recompute."""

    def forward(self, *args, **kwargs):
        return checkpoint(super(sub, self).forward, *args, use_reentrant=False, **kwargs)

    sub = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
    return sub


def unit_modules(model: nn.Module) -> list[str]:
    """The paths of zfunc's default units but the root: each ModuleList child, those nested in
    another left out (zf.recompute checkpoints the outer one, with them inside)."""
    paths = [f"{name}.{i}" if name else str(i) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
             for i in range(len(m))]
    return [p for p in paths if not any(p.startswith(o + ".") for o in paths)]


def checkpoint_units(model: nn.Module) -> nn.Module:
    """``model`` with each unit's module called under checkpointing (``_checkpointed_class``), in place."""
    for path in unit_modules(model):
        module = model.get_submodule(path)
        module.__class__ = _checkpointed_class(type(module))
    return model


def reference(name: str, kw: dict, steps: int = 3, batch_size: int = 4, seed: int = 0,
              clip: float | None = None) -> dict:
    """Plain PyTorch, one process, the global batch: the units checkpointed, torch.optim.AdamW as
    cases.reference runs it; parameters and leaf modules' calls (``count_calls``) by the model's own
    names."""
    model = checkpoint_units(build(name, seed, **kw))
    shape_model = build(name, seed, **kw)
    calls = count_calls(model)
    losses = train_plain(name, model, steps, batch_size, seed, clip, shape_model=shape_model)
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "losses": losses,
            "calls": calls}


def count_calls(model: nn.Module) -> dict[str, int]:
    """Every leaf module's calls, counted by a forward pre-hook (the dict fills as the model runs)."""
    calls: dict[str, int] = {}
    for path, m in model.named_modules():
        if not any(True for _ in m.children()):
            calls[path] = 0
            m.register_forward_pre_hook(lambda mod, args, path=path: calls.__setitem__(path, calls[path] + 1))
    return calls


def run(name: str, kw: dict, composition: str, recompute: bool, steps: int = 3, per_rank: int = 2,
        seed: int = 0, swap: str | None = None, where: str = "outer") -> dict:
    """``steps`` steps of ``composition`` (compositions.COMPOSITIONS; ``swap``: an NVMe entry's
    folder) on this rank's part of each global batch, ``zf.recompute`` applied ``where`` ("outer":
    around the whole step; "inner": around the train step, under every other transform).
    Returns the full parameters, each step's loss, each leaf module's calls."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(name, seed, **kw)
    shape_model = copy.deepcopy(model)
    calls = count_calls(model)
    spec = dict(COMPOSITIONS[composition])
    stage = spec.pop("stage")
    if spec.get("offload", {}).get("kind") == "nvme":
        spec["offload"] = {**spec["offload"], "path": swap}

    def loss_fn(params, b):
        return loss(name, zf.apply(model, params, b[0]), b[1])

    if recompute and where == "inner":
        base = zf.recompute(zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=0.01)))
        step = _compose_around(base, stage, spec)
    else:
        step = compose(stage, loss_fn, **spec)
        step = zf.recompute(step) if recompute else step
    state = step.init(model)
    losses = []
    micro = spec.get("micro")
    for i in range(steps):
        b = local(batch(name, shape_model, i, per_rank * world, seed), rank, world)
        state, metrics = step(state, micro_batches(b, micro) if micro else b)
        losses.append(metrics["loss"].item())
    with state:  # removes swap files (offload_nvme)
        return {"params": zf.gather_params(state), "losses": losses, "calls": dict(calls),
                "composition": step.composition}


def _compose_around(step, stage: int, spec: dict):
    """``spec``'s transforms (compositions.COMPOSITIONS' keywords) around a step built already."""
    if spec.get("clip") is not None:
        raise ValueError("clipping is the optimizer's: compose it with cases.compose")
    if spec.get("micro"):
        step = zf.accumulate(step, spec["micro"])
    if spec.get("precision"):
        step = zf.mixed_precision(step, **spec["precision"])
    if spec.get("offload"):
        kw = dict(spec["offload"])
        step = getattr(zf, "offload_" + kw.pop("kind"))(step, **kw)
    return {0: lambda s: s, 1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step)


def step_peak(recompute: bool, blocks: int = 10, d: int = 128, hidden: int = 2048, tokens: int = 512) -> dict:
    """Run in a fresh process (``python tests/harness/recompute.py 0|1``): the RSS peak above the
    state's over the first two steps of ``zero3(offload_cpu([recompute](f)))`` on an MLP of
    ``blocks`` residual blocks ``d -> hidden -> d``, and the bytes of the activations inside the
    blocks that backward would keep without recomputation (each block's hidden layer and GELU's
    output, fp32)."""
    from zfunc.testing import memory

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                        for _ in range(blocks))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    model = Wide()
    step = zf.train_step(lambda p, x: zf.apply(model, p, x).square().mean(), zf.optim.adamw(1e-3))
    step = zf.zero3(zf.offload_cpu(zf.recompute(step) if recompute else step))
    state = step.init(model)
    x = torch.randn(tokens, d)
    before = memory.rss()
    memory.reset_peak()
    for _ in range(2):
        state, _ = step(state, x)
    return {"peak": memory.peak() - before, "activations": blocks * 2 * tokens * hidden * 4}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(step_peak(sys.argv[1] == "1")))
