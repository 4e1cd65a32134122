"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` through the engine: Muon on every 2-D parameter (or
those a ``use_muon`` flag names), AdamW on the rest, at ZeRO stage 0 (DeepSpeed's bug: it ran SGD
there), 1, 2, 3, with gradient accumulation (DeepSpeed's bug: not the big batch's) and with the
optimizer offloaded (DeepSpeed's bug: not the same as without), equal to torch's Muon and AdamW side
by side on the global batch, clipped to norm 1 (DeepSpeed's default gradient_clipping)."""
from __future__ import annotations

import copy

import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from engines import GLOBAL_MICRO, gpt_loss, micro_batches
from models import batch, build, loss
from workers import workers
from zfunc.engine.config import parse

STEPS, GAS = 3, 2
PARAMS = {"lr": 0.02, "weight_decay": 0.01}


def config(stage: int, offload: bool = False) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_batch_size": GLOBAL_MICRO * GAS, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "Muon", "params": PARAMS}, "zero_optimization": zero}


def engine_run(cfg: dict) -> dict:
    model = build("gpt")
    shape = copy.deepcopy(model)
    rank, world = zf.dist.rank(), zf.dist.world_size()
    engine = zf.initialize(model, cfg, loss_fn=gpt_loss)
    data = micro_batches("gpt", shape, rank, world, GAS)
    for _ in range(STEPS):
        engine.train_batch(data)
    out = engine.params()
    engine.close()
    return out


def torch_reference() -> dict:
    model = build("gpt")
    named = list(model.named_parameters())
    opts = [torch.optim.Muon([p for _, p in named if p.dim() == 2], **PARAMS),
            torch.optim.AdamW([p for _, p in named if p.dim() != 2], **PARAMS)]
    for i in range(STEPS):
        for o in opts:
            o.zero_grad()
        for k in range(GAS):
            x, y = batch("gpt", model, i * GAS + k, GLOBAL_MICRO)
            (loss("gpt", model(x), y) / GAS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed 0.19's default gradient_clipping
        for o in opts:
            o.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_config_reads_muon():
    o = parse(config(0), 1).optimizer
    assert (o.type, o.lr, o.weight_decay, o.momentum, o.nesterov, o.ns_steps) == ("muon", 0.02, 0.01, 0.95, True, 5)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_engine_muon_equals_torch_at_every_stage(world):
    expected = torch_reference()
    for stage in (0, 1, 2, 3):
        for got in workers(world).run(engine_run, config(stage)):
            assert_close_to(got, expected)


def test_engine_muon_offloaded_equals_torch():
    expected = torch_reference()
    for stage in (2, 3):
        for got in workers(2).run(engine_run, config(stage, offload=True)):
            assert_close_to(got, expected)
