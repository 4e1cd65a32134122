"""The engine ``zfunc.deepspeed.initialize`` returns, as transformers' Trainer, accelerate and peft
hold it (zfunc/deepspeed/engine.py), in one process: an ``nn.Module`` whose ``module`` is the
user's model running on the engine's weights, ``config`` read as the dict, ``backward(loss,
scale_wrt_gas=False)``, ``set_gradient_accumulation_boundary``, live param groups a scheduler
built on the returned optimizer sets, the 16-bit state dict with and without frozen parameters,
checkpoints that exclude frozen parameters, ZeRO-3's ``ds_*`` attributes, and the refusals of
what zfunc does not do (each naming what to use instead)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zfunc as zf
import zfunc.deepspeed as zds
from zfunc.deepspeed.zero import ZeroParamStatus

TOL = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y=None):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        out = self.head(x)
        return out if y is None else F.cross_entropy(out, y)


def config(stage=3, gas=1, **extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}, **extra}


def batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def test_an_nn_module_whose_module_runs_on_the_engines_weights():
    model = Net()
    reference = copy.deepcopy(model)
    engine, optimizer, _, scheduler = zds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                                     config=config())
    assert isinstance(engine, nn.Module) and isinstance(engine, zds.DeepSpeedEngine) and scheduler is None
    assert engine.config.get("zero_optimization")["stage"] == 3 and "zero_optimization" in engine.config
    assert engine.module is model
    x = torch.randn(2, 8)
    torch.testing.assert_close(engine.module(x), reference(x), **TOL)  # outside a step: on the state's weights
    sd = model.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(sd[name], t, **TOL)
    for i, p in enumerate(model.parameters()):
        assert (p.ds_id, p.ds_status, p.ds_numel, p.ds_shape) == (i, ZeroParamStatus.NOT_AVAILABLE, p.numel(), p.shape)
    with zds.zero.GatheredParameters(list(model.parameters())):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in model.parameters())
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert optimizer.overflow is False and engine.training
    hooks = optimizer.parameter_offload  # TRL removes DeepSpeed's module hooks around generation: zfunc has none
    assert list(hooks.module.named_parameters(recurse=True)) == [] and hooks.forward_hooks == []
    engine.close()


def _trainer_loop(engine, micro, gas, divide):
    """accelerate's DeepSpeedEngineWrapper.backward under transformers' Trainer: the loss divided by
    the accumulation steps, ``scale_wrt_gas=False``, the boundary set before each backward."""
    losses = []
    for k, (x, y) in enumerate(micro):
        loss = engine(x, y)
        losses.append(float(loss))
        boundary = (k + 1) % gas == 0
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss / gas if divide else loss, scale_wrt_gas=not divide)
        if boundary:
            engine.step()
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_a_divided_loss_without_scale_wrt_gas_trains_as_deepspeeds_own_scaling(stage):
    runs = []
    for divide in (False, True):
        model = Net()
        engine, *_ = zds.initialize(model=model, config={**config(stage, gas=2),
                                                         "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}})
        runs.append((_trainer_loop(engine, batches(6), 2, divide), engine.params()))
        engine.close()
    torch.testing.assert_close(torch.tensor(runs[0][0]), torch.tensor(runs[1][0]), **TOL)
    for name, t in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], t, **TOL)


def test_a_boundary_set_early_makes_the_update():
    model = Net()
    engine, *_ = zds.initialize(model=model, config={**config(2, gas=4), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    before = engine.params()
    x, y = batches(1)[0]
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    assert any(not torch.equal(before[n], t) for n, t in engine.params().items())
    engine.close()


def test_a_scheduler_built_on_the_returned_optimizer_sets_the_lr():
    """The Trainer's order: initialize with a torch optimizer and no scheduler, then a scheduler on the
    optimizer initialize returned (a LambdaLR through accelerate's wrapper there; here its writes to
    the groups), stepped after each update: plain torch with the same scheduler."""
    model = Net()
    reference = copy.deepcopy(model)
    lam = lambda k: [0.0, 1.0, 0.5, 0.25, 0.125][min(k, 4)]  # noqa: E731
    engine, optimizer, _, _ = zds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                             config=config(3, gradient_clipping=0.0))
    steps = 0

    def schedule():
        for g in optimizer.param_groups:
            g["lr"] = 0.05 * lam(steps)
    schedule()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)
    for x, y in batches(4):
        engine.backward(engine(x, y))
        engine.step()
        steps += 1
        schedule()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
        ref_sched.step()
        assert optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for name, t in reference.named_parameters():
        torch.testing.assert_close(engine.params()[name], t.detach(), **TOL)
    engine.close()


class Scored(Net):
    """A model with another entry point than its forward, as DeepSpeed-Chat's reward model's
    ``forward_value``, and a method that computes nothing."""

    note = "scored"

    def score(self, x, *, scale=1.0):
        return {"values": self(x).sum(-1) * scale}

    def mark(self):
        self.marked = True


@pytest.mark.parametrize("stage", [2, 3])
def test_the_models_own_methods_called_on_the_engine_run_on_its_weights_and_train(stage):
    """DeepSpeed's engine hands what it lacks to its module: ``engine.score(x)`` evaluates under
    ``no_grad``, and with gradients on is differentiable, so ``engine.backward`` of a loss made from
    it then ``step()`` trains as plain torch does; a method that returns nothing leaves no pass
    open; attributes and ``nn.Module``'s own methods are the engine's or the model's as before."""
    model = Scored()
    reference = copy.deepcopy(model)
    engine, *_ = zds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                config=config(stage, gradient_clipping=0.0))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    assert engine.note == "scored" and engine.eval() is engine and engine.train() is engine
    with pytest.raises(AttributeError):
        engine.no_such_thing
    for x, y in batches(3):
        with torch.no_grad():
            torch.testing.assert_close(engine.score(x)["values"], reference.score(x)["values"], **TOL)
        engine.mark()
        loss = (engine.score(x, scale=0.5)["values"] - y.float()).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        ref_loss = (reference.score(x, scale=0.5)["values"] - y.float()).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)
    assert model.marked
    for name, t in reference.named_parameters():
        torch.testing.assert_close(engine.params()[name], t.detach(), **TOL)
    engine.close()


def _frozen_net():
    model = Net()
    model.blocks[0].requires_grad_(False)
    return model


def test_frozen_parameters_left_out_of_the_16bit_state_dict_and_of_a_checkpoints_load(tmp_path):
    model = _frozen_net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    engine, *_ = zds.initialize(model=model, optimizer=opt, config=config(3, bf16={"enabled": True}))
    assert engine.zero_gather_16bit_weights_on_model_save()
    whole = engine._zero3_consolidated_16bit_state_dict()
    assert set(whole) == set(Net().state_dict()) and all(t.dtype == torch.bfloat16 for t in whole.values())
    trainable = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert set(trainable) == {k for k in whole if not k.startswith("blocks.0.")}
    x, y = batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    saved = engine.params()

    other = _frozen_net()
    with torch.no_grad():
        other.blocks[0].weight.fill_(0.25)  # the loading model's own frozen weights
    opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=0.05)
    engine2, *_ = zds.initialize(model=other, optimizer=opt, config=config(3, bf16={"enabled": True}))
    engine2.load_checkpoint(str(tmp_path), load_module_strict=False)
    loaded = engine2.params()
    assert torch.equal(loaded["blocks.0.weight"], torch.full((8, 8), 0.25))
    for name, t in saved.items():
        if not name.startswith("blocks.0."):
            assert torch.equal(loaded[name], t), name
    engine.close()
    engine2.close()


@pytest.mark.parametrize("key,value,named", [
    ("tensor_parallel", {"autotp_size": 2}, "ZeRO-3"),
    ("sequence_parallel_size", 2, "Ulysses"),
    ("moe", {"enabled": True}, "Mixtral"),
    ("expert_parallel", {"enabled": True}, "experts"),
    ("hybrid_engine", {"enabled": True}, "zf.bind"),
])
def test_what_zfunc_does_not_do_is_refused_at_initialize(key, value, named):
    with pytest.raises(ValueError, match=f"{key}.*{named}"):
        zds.initialize(model=Net(), config={**config(), "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                                            key: value})


def test_a_trivial_tensor_parallel_section_is_accepted():
    engine, *_ = zds.initialize(model=Net(), config={**config(), "tensor_parallel": {"autotp_size": 1},
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    engine.close()


def test_accelerates_mpu_for_ulysses_is_refused():
    with pytest.raises(NotImplementedError, match="Ulysses"):
        zds.initialize(model=Net(), config=config(), mpu=object())


def _parts(engine) -> dict:
    from zfunc.checkpoint.sharded import _parts as parts
    out = {}
    for role, node in zip(*parts(engine.state)[:2]):
        leaves = node.leaves if hasattr(node, "leaves") else [node]
        out[role] = [None if t is None else t.detach().clone() for t in leaves]
    return out


def _equal(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def _trained(steps, seed):
    engine, *_ = zds.initialize(model=Net(), config={**config(3, bf16={"enabled": True}),
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                                                     "scheduler": {"type": "WarmupLR",
                                                                   "params": {"warmup_num_steps": 5}}})
    for x, y in batches(steps + seed)[seed:]:
        engine.backward(engine(x, y))
        engine.step()
    return engine


@pytest.mark.parametrize("how", ["load_optimizer_states=False", "load_module_only=True",
                                 "load_optimizer_states=False, load_lr_scheduler_states=False"])
def test_partial_loads_keep_what_deepspeed_keeps(tmp_path, how):
    """A 3-step checkpoint loaded into a 1-step engine: the weights (and fp32 master weights) are the
    checkpoint's; the moments and per-parameter step counts stay the loader's; the update count (the
    lr schedule's position) and the engine's counters are the checkpoint's unless the scheduler's
    states or everything but the module are left out."""
    saved = _trained(3, 0)
    saved.save_checkpoint(str(tmp_path))
    theirs = _parts(saved)
    loader = _trained(1, 3)
    mine, mine_lr = _parts(loader), loader.get_lr()
    kwargs = dict(kv.split("=") for kv in how.split(", "))
    loader.load_checkpoint(str(tmp_path), **{k: v == "True" for k, v in kwargs.items()})
    now = _parts(loader)
    only = "load_module_only" in kwargs
    keep_count = only or "load_lr_scheduler_states" in kwargs
    for role, values in now.items():
        if role in ("params", "master", "frozen"):
            assert _equal(values, theirs[role]), role
        elif (role == "count" and not only) or (role.startswith("opt_state") and role.endswith(".count")
                                                 and not keep_count):
            assert _equal(values, theirs[role]), role
        else:
            assert _equal(values, mine[role]), role
    assert loader.global_steps == (1 if only else 3)
    assert loader.get_lr() == (mine_lr if keep_count else saved.get_lr())
    x, y = batches(1)[0]
    loader.backward(loader(x, y))  # and it trains on
    loader.step()
    saved.close()
    loader.close()


def test_the_schedulers_states_alone_are_refused(tmp_path):
    engine = _trained(1, 0)
    engine.save_checkpoint(str(tmp_path))
    with pytest.raises(NotImplementedError, match="load_optimizer_states=False too"):
        engine.load_checkpoint(str(tmp_path), load_lr_scheduler_states=False)
    engine.close()
