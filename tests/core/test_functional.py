"""The functional API on its own: apply, value_and_grad, grad, gather_params."""
import copy

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from zfunc.pytree import tree_leaves, tree_map
from assertions import assert_close_to
from cases import reference, run_research_step
from models import batch, build
from workers import workers


def test_apply_with_a_plain_dict_matches_the_module():
    model = build("gpt")
    x, _ = batch("gpt", model, 0, 3)
    params = {k: v.detach() * 1.5 for k, v in model.named_parameters()}
    expected = torch.func.functional_call(model, params, (x,))
    assert torch.equal(zf.apply(model, params, x), expected)


def test_value_and_grad_on_a_plain_pytree_matches_autograd():
    model = build("odd_mlp")
    x, y = batch("odd_mlp", model, 0, 4)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss_fn = lambda p, b: F.mse_loss(zf.apply(model, p, b[0]), b[1])  # noqa: E731
    value, grads = zf.value_and_grad(loss_fn)(params, (x, y))
    F.mse_loss(model(x), y).backward()
    assert value.item() == pytest.approx(F.mse_loss(model(x), y).item())
    zf.testing.assert_trees_all_close(grads, {k: v.grad for k, v in model.named_parameters()}, rtol=1e-6)
    zf.testing.assert_trees_all_close(zf.grad(loss_fn)(params, (x, y)), grads, rtol=0)


def test_value_and_grad_with_aux():
    model = build("no_list")
    x, y = batch("no_list", model, 0, 4)
    params = dict(model.named_parameters())

    def loss_fn(p, b):
        out = zf.apply(model, p, b[0])
        return F.mse_loss(out, b[1]), {"mean": out.mean()}

    (value, aux), _ = zf.value_and_grad(loss_fn, has_aux=True)(params, (x, y))
    assert aux["mean"].item() == pytest.approx(model(x).mean().item(), rel=1e-6)


def test_gather_params_then_apply_reproduces_the_trained_model():
    model = build("gpt")
    twin = copy.deepcopy(model)
    loss_fn = lambda p, b: F.cross_entropy(zf.apply(model, p, b[0]).flatten(0, 1), b[1].flatten())  # noqa: E731
    state = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(1e-2))).init(model)
    params = zf.gather_params(state)
    assert list(params) == [n for n, _ in twin.named_parameters()]  # tied head stored once
    x, _ = batch("gpt", twin, 0, 2)
    assert torch.equal(zf.apply(model, params, x), twin(x))


def test_tied_weights_are_one_leaf():
    model = build("gpt")
    state = zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)).init(model)
    total = sum(p.numel() for p in build("gpt").parameters())  # parameters() dedups ties
    assert sum(t.numel() for t in state.params.leaves) == total


@pytest.mark.parametrize("world", [1, 2])
def test_research_step_from_value_and_grad_gets_zero3(world):
    expected = reference("gpt", {}, steps=3, batch_size=2 * world)
    for r in workers(world).run(run_research_step, "gpt", {}, 3, 2):
        assert_close_to(r["params"], expected["params"])


def test_state_is_a_pytree():
    model = build("frozen_bn")
    state = zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3))).init(model)
    leaves = tree_leaves(state)
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    doubled = tree_map(lambda t: t * 2 if t.is_floating_point() else t, state)
    assert isinstance(doubled, zf.State)
    assert torch.equal(doubled.params.leaves[0], state.params.leaves[0] * 2)
    flat, spec = torch.utils._pytree.tree_flatten(state)  # torch.func sees through it too
    assert len(flat) == len(leaves)
