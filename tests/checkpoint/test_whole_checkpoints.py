"""Checkpoints of whole-tensor optimizers move to another world size exactly: Muon + AdamW and
Adafactor saved at W = 2 under zero3, loaded at W = 3 (another shard layout, other owners), hold the
same numbers (parameters, momentum, moments, Adafactor's factors, step counts) though each world
size lays the units out for its own owners, and training goes on equal to torch trained without a
break."""
from __future__ import annotations

import os

import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from checkpoints import assert_same_entries
from models import batch, build, local, loss
from optim_reference import torch_recipe, train_torch, zfunc_recipe
from workers import workers

BATCH = 6  # divides over W = 2, 3
BEFORE, AFTER = 3, 2


def _step(opt_name: str, stage: int):
    model, twin = build("gpt").double(), build("gpt").double()

    def loss_fn(params, b):
        x, y = b
        return loss("gpt", zf.apply(model, params, x), y)

    opt = zfunc_recipe(torch.float64) if opt_name == "recipe" else zf.optim.adafactor(0.05)
    return model, twin, {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](zf.train_step(loss_fn, opt))


def save_after(opt_name: str, stage: int, directory: str) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, twin, step = _step(opt_name, stage)
    state = step.init(model)
    for i in range(BEFORE):
        state, _ = step(state, local(batch("gpt", twin, i, BATCH), rank, world))
    zf.checkpoint.save(state, directory, "a")
    return zf.gather_params(state)


def load_and_go_on(opt_name: str, stage: int, directory: str, again: str) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, twin, step = _step(opt_name, stage)
    state, _ = zf.checkpoint.load(step.init(model), directory, "a")
    loaded = zf.gather_params(state)
    zf.checkpoint.save(state, again, "a")
    for i in range(BEFORE, BEFORE + AFTER):
        state, _ = step(state, local(batch("gpt", twin, i, BATCH), rank, world))
    return {"loaded": loaded, "params": zf.gather_params(state)}


TORCH = {"recipe": torch_recipe, "adafactor": lambda m: [torch.optim.Adafactor(m.parameters(), lr=0.05)]}


@pytest.mark.parametrize("opt_name", [pytest.param("recipe", marks=pytest.mark.slow), "adafactor"])
def test_w2_to_w3_exact(opt_name, tmp_path):
    first, second = os.path.join(tmp_path, "w2"), os.path.join(tmp_path, "w3")
    saved = workers(2).run(save_after, opt_name, 3, first)[0]
    for r in workers(3).run(load_and_go_on, opt_name, 3, first, second):
        for k, v in saved.items():
            assert torch.equal(r["loaded"][k], v), k
        assert_close_to(r["params"], train_torch("gpt", TORCH[opt_name], BEFORE + AFTER, BATCH, dtype=torch.float64))
    differ = assert_same_entries(first, second)
    if opt_name == "adafactor":  # every parameter whole: the owner layouts of W = 2 and 3 differ, read across
        assert differ > 0
