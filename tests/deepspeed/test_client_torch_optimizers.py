"""zfunc.deepspeed.client: a script's torch.optim.Muon, RMSprop or Adafactor (any class but the Adams and
SGD zfunc fuses) runs as itself (zf.optim.from_torch), param groups too, equal to the script's own
optimizer in a plain loop, under zero3 at W = 1 and 2."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc as zf
from assertions import assert_close_to
from models import local
from workers import workers
from zfunc.deepspeed.client import optimizer_from_client

STEPS = 4


def matrices() -> nn.Module:
    """Only 2-D parameters, as a script giving every parameter to torch.optim.Muon needs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False), nn.Tanh(),
                         nn.Linear(16, 3, bias=False))


def data(step: int, size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)


def make(kind: str, model):
    if kind == "muon":
        return torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01)
    if kind == "rmsprop_groups":
        ps = list(model.parameters())
        return torch.optim.RMSprop([{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3, "alpha": 0.9}], lr=1e-2)
    return torch.optim.Adafactor(model.parameters(), lr=0.05)


def torch_loop(kind: str, batch: int) -> dict:
    model = matrices()
    opt = make(kind, model)
    for i in range(STEPS):
        x, y = data(i, batch)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def zfunc_loop(kind: str, per_rank: int) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = matrices()
    opt = optimizer_from_client(make(kind, model), model)
    step = zf.zero3(zf.train_step(lambda p, b: nn.functional.mse_loss(zf.apply(model, p, b[0]), b[1]), opt))
    state = step.init(model)
    for i in range(STEPS):
        state, _ = step(state, local(data(i, per_rank * world), rank, world))
    return zf.gather_params(state)


@pytest.mark.parametrize("kind", ["muon", "rmsprop_groups", "adafactor"])
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_scripts_torch_optimizer_runs_as_itself(kind, world):
    expected = torch_loop(kind, 4 * world)
    for got in workers(world).run(zfunc_loop, kind, 4):
        assert_close_to(got, expected)
