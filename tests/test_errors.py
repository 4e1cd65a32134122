"""Bad input gets a clear error naming what is wrong (DESIGN.md §3)."""
import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from models import build


def _step(model, transform=zf.zero3, **kw):
    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(zf.apply(model, params, x), y)

    return transform(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), **kw)


def test_batch_that_does_not_fit_the_model():
    model = build("no_list")
    step = _step(model)
    state = step.init(model)
    with pytest.raises(RuntimeError, match=r"(?s)batch of \[\(4, 5\) float32, \(4, 2\) float32\].*matches what the model expects"):
        step(state, (torch.randn(4, 5), torch.randn(4, 2)))


def test_unit_policy_naming_a_missing_module():
    model = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1)
    with pytest.raises(ValueError, match=r"'block\.1'.*Did you mean 'blocks\.1'"):
        _step(model, units=["block.1"]).init(model)


def test_state_from_another_model():
    a, b = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1), build("deep_mlp", d_in=3, width=4, depth=3, d_out=1)
    state_a = _step(a).init(a)
    with pytest.raises(ValueError, match=r"different model.*blocks\.2"):
        _step(b)(state_a, (torch.randn(2, 3), torch.randn(2, 1)))


def test_state_from_another_shape_of_the_same_model():
    a, b = build("deep_mlp", d_in=3, width=4, depth=2, d_out=1), build("deep_mlp", d_in=3, width=5, depth=2, d_out=1)
    state_a = _step(a).init(a)
    with pytest.raises(ValueError, match=r"different model: parameter 'inp.weight' has shape \(5, 3\)"):
        _step(b)(state_a, (torch.randn(2, 3), torch.randn(2, 1)))


def test_state_from_a_step_of_another_stage():
    model = build("no_list")
    state = _step(model, zf.zero1).init(model)
    with pytest.raises(ValueError, match=r"built by zero1\(train_step\) at world size 1, but this step is zero3\(train_step\)"):
        _step(model)(state, (torch.randn(2, 3), torch.randn(2, 2)))


def test_model_whose_storage_was_taken():
    model = build("no_list")
    _step(model).init(model)
    with pytest.raises(ValueError, match="held by a zfunc State.*Step.init"):
        _step(model).init(model)


def test_zero_applied_twice():
    model = build("no_list")
    with pytest.raises(ValueError, match="already ZeRO stage 1"):
        zf.zero3(_step(model, zf.zero1))


def test_mixed_dtypes_in_one_unit():
    model = build("no_list")
    model.net[0].bias.data = model.net[0].bias.data.double()
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        _step(model).init(model)


def test_loss_must_be_a_scalar():
    model = build("no_list")
    step = zf.train_step(lambda p, b: zf.apply(model, p, b[0]), zf.optim.adamw(1e-3))
    state = step.init(model)
    with pytest.raises(TypeError, match="scalar"):
        step(state, (torch.randn(2, 3), None))
