"""``zfunc.deepspeed.initialize``: DeepSpeed's four values, its config sources and flags, its data
loader, and where the optimizer and schedule come from (the config's; the script's torch optimizer
and scheduler; the config's scheduler on the script's optimizer; param groups in
``model_parameters``), each trained against zf.initialize's engine or plain PyTorch.
test_script_against_deepspeed.py runs the whole script against real DeepSpeed (slow tier)."""
import argparse
import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import zfunc as zf
import zfunc.deepspeed as zds
from deepspeed_script import Net, dataset, ds_config
from workers import workers

TOL = dict(rtol=1e-5, atol=1e-6)


def _loop(engine, batches):
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _sampler_batches(micro: int, rank: int, world: int) -> list:
    """DeepSpeed's loader's micro-batches: DistributedSampler (shuffled, seed 0) cut in ``micro``."""
    data = dataset()
    order = list(DistributedSampler(data, num_replicas=world, rank=rank))
    return [tuple(t[order[i:i + micro]] for t in data.tensors) for i in range(0, len(order), micro)]


def face_against_engine(stage: int, gas: int) -> None:
    """The same config through zfunc.deepspeed.initialize and zf.initialize: the loader's batches
    are DeepSpeed's, and both engines end on the same weights."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    config = ds_config(stage, gas, world)
    torch.manual_seed(0)
    engine, optimizer, loader, scheduler = zds.initialize(model=Net(), config=config, training_data=dataset())
    batches = list(loader)
    expected = _sampler_batches(4, rank, world)
    assert len(loader) == len(expected) == len(batches)
    for got, want in zip(batches, expected):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    _loop(engine, batches)
    torch.manual_seed(0)
    reference = zf.initialize(Net(), config)
    _loop(reference, expected)
    assert isinstance(engine, zf.Engine) and optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    assert engine.global_steps == reference.global_steps == len(batches) // gas
    ours, theirs = engine.params(), reference.params()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    assert optimizer.param_groups[0]["lr"] == reference.get_lr()[0] == scheduler.get_last_lr()[0]
    engine.close()
    reference.close()


@pytest.mark.parametrize("world, stage, gas", [(1, 0, 2), (2, 3, 2), (2, 1, 1)])
def test_initialize_trains_as_zf_initialize_on_deepspeeds_batches(world, stage, gas):
    workers(world).run(face_against_engine, stage, gas)


def test_the_config_from_args_or_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(1, 1, 1)))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = zds.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.local_rank == -1
    engine, *_ = zds.initialize(args=args, model=Net())
    assert engine.zero_optimization_stage() == 1 and engine.train_batch_size() == 4
    assert args.local_rank == engine.local_rank == 0  # as DeepSpeed's engine sets it
    with pytest.raises(ValueError, match="both as args.deepspeed_config and as config="):
        zds.initialize(args=args, model=Net(), config=ds_config(1, 1, 1))
    old = parser.parse_args(["--deepscale_config", str(path)])  # the deprecated name still works
    assert zds.initialize(args=old, model=Net(), config_params=None)[0].train_batch_size() == 4
    with pytest.raises(ValueError, match="no DeepSpeed config: pass --deepspeed_config"):
        zds.initialize(args=parser.parse_args([]), model=Net())
    with pytest.raises(ValueError, match="requires a model"):
        zds.initialize(config=ds_config(1, 1, 1))
    with pytest.raises(NotImplementedError, match="mpu=.*model parallelism"):
        zds.initialize(model=Net(), config=ds_config(1, 1, 1), mpu=object())
    engine, optimizer, loader, scheduler = zds.initialize(model=Net(), config_params={"train_batch_size": 2, "optimizer": {
        "type": "SGD", "params": {"lr": 0.1}}})
    assert loader is None and scheduler is None and optimizer.param_groups[0]["lr"] == 0.1


def test_add_config_arguments_adds_deepspeeds_flags():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    def flags(parser):
        return {a.dest: (tuple(a.option_strings), a.default, a.type, type(a).__name__) for a in parser._actions}

    assert flags(zds.add_config_arguments(argparse.ArgumentParser())) == flags(
        deepspeed.add_config_arguments(argparse.ArgumentParser()))


def _torch_reference(model, opt, batches, lr_at=None, sched=None) -> tuple[list, list]:
    """Plain PyTorch on ``batches``: losses, and the lr after each update."""
    losses, lrs = [], []
    for k, (x, y) in enumerate(batches):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"] if lr_at is None else lr_at(k + 1))
    return losses, lrs


def _face_run(engine, optimizer, scheduler, batches) -> tuple[list, list]:
    losses, lrs = [], []
    for x, y in batches:
        losses += _loop(engine, [(x, y)])
        lrs.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr() == engine.get_lr() == [lrs[-1]]
    return losses, lrs


PLAIN = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0}


def test_a_client_optimizer_and_scheduler_train_as_torch():
    """``optimizer=torch.optim.AdamW(...)``, ``lr_scheduler=StepLR(...)``: the engine steps the
    scheduler after each update, as DeepSpeed's does; the returned objects show its lr."""
    batches = _sampler_batches(4, 0, 1)[:6]
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    engine, optimizer, loader, scheduler = zds.initialize(model=model, optimizer=opt, config=PLAIN,
                                                          lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    assert scheduler.state_dict()["last_epoch"] == 0 and optimizer.param_groups[0]["weight_decay"] == 0.1
    ours = _face_run(engine, optimizer, scheduler, batches)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.02, weight_decay=0.1)
    theirs = _torch_reference(ref_model, ref_opt, batches, sched=torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5))
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), **TOL)
    assert scheduler.state_dict()["last_epoch"] == 6
    with pytest.raises(NotImplementedError, match="the engine steps the schedule"):
        scheduler.step()
    with pytest.raises(NotImplementedError, match="setting param_groups\\[i\\]\\['lr'\\] is not supported"):
        optimizer.param_groups[0]["lr"] = 1.0


def test_the_configs_scheduler_on_a_client_optimizer():
    """DeepSpeed builds the config's scheduler on the script's optimizer: WarmupLR from its lr."""
    batches = _sampler_batches(4, 0, 1)[:5]
    section = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}
    schedule = zf.optim.lr.from_config(section, 0.03)
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    engine, optimizer, _, scheduler = zds.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.03),
                                                     config={**PLAIN, "scheduler": section})
    assert scheduler.state_dict() == {"last_batch_iteration": -1} and scheduler.get_lr() == [schedule(0)]
    ours = _face_run(engine, optimizer, scheduler, batches)
    theirs = _torch_reference(ref_model, torch.optim.Adam(ref_model.parameters(), lr=0.03), batches, lr_at=schedule)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), **TOL)
    assert scheduler.state_dict() == {"last_batch_iteration": 4}


def test_the_configs_cosine_scales_each_groups_own_lr():
    """DeepSpeed's WarmupCosineLR on a script's optimizer scales each param group's initial lr by the
    cosine's ratio (WarmupLR and WarmupDecayLR set one lr for every group)."""
    batches = _sampler_batches(4, 0, 1)[:5]
    section = {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 2}}
    ratio = zf.optim.lr.from_config(section, 1.0)
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if not n.startswith("head")], "lr": 0.01},
                {"params": list(m.head.parameters()), "lr": 0.04}]

    engine, optimizer, _, scheduler = zds.initialize(model=model, optimizer=torch.optim.AdamW(groups(model)),
                                                     config={**PLAIN, "scheduler": section})
    losses = []
    for k, batch in enumerate(batches):
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01 * ratio(k), 0.04 * ratio(k)])
        losses += _loop(engine, [batch])
    ref_opt = torch.optim.AdamW(groups(ref_model))
    theirs = []
    for k, (x, y) in enumerate(batches):
        for g, lr in zip(ref_opt.param_groups, (0.01, 0.04)):
            g["lr"] = lr * ratio(k)
        loss = F.cross_entropy(ref_model(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        theirs.append(loss.item())
    assert ratio(2) > 0 and ratio(2) != ratio(4)  # the groups' lrs move
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(theirs), **TOL)


def test_param_groups_in_model_parameters_with_the_configs_optimizer():
    """``model_parameters`` as param groups (no weight decay on biases): the config's AdamW over
    them, as DeepSpeed builds torch's; and a subset of the parameters is refused, named."""
    batches = _sampler_batches(4, 0, 1)[:4]
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if not n.endswith("bias")], "weight_decay": 0.5},
                {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]

    config = {**PLAIN, "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.5}}}
    engine, optimizer, _, scheduler = zds.initialize(model=model, model_parameters=groups(model), config=config)
    assert scheduler is None and [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    ours = _loop(engine, batches)
    theirs, _ = _torch_reference(ref_model, torch.optim.AdamW(groups(ref_model), lr=0.02), batches)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), **TOL)
    model = Net()
    with pytest.raises(ValueError, match="in no param group"):
        zds.initialize(model=model, model_parameters=list(model.head.parameters()), config=config)


def pipeline_through_the_face() -> tuple:
    """zf's pipeline engine through zfunc.deepspeed.initialize: the same losses as zf.initialize's,
    the config's optimizer and schedule in the returned views."""
    from pipelines import config, micro_batch, pipe

    cfg = config(2, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}})
    engine, optimizer, loader, scheduler = zds.initialize(model=pipe(2), config=cfg)
    reference = zf.initialize(pipe(2), cfg)
    assert loader is None and optimizer is engine.optimizer and scheduler.state_dict() == {"last_batch_iteration": -1}
    for i in range(3):
        data = [micro_batch(i, m, 0) for m in range(2)]
        assert float(engine.train_batch(iter(data))) == float(reference.train_batch(iter(data)))
        assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == reference.get_lr()[0]
    assert engine.gradient_accumulation_steps() == 2 and engine.dp_world_size == 1
    # training_data: DeepSpeed's pipeline loader, in order, repeating; train_batch() draws from it
    pairs = [micro_batch(i, m, 0) for i in range(2) for m in range(2)]
    data = torch.utils.data.TensorDataset(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))
    fed, _, fed_loader, _ = zds.initialize(model=pipe(2), config=cfg, training_data=data)
    reference = zf.initialize(pipe(2), cfg)
    assert fed_loader is not None and fed_loader is fed.training_dataloader  # both stages read data here
    for i in range(3):  # the third step starts the data over
        step = [pairs[(2 * i + m) % 4] for m in range(2)]
        assert float(fed.train_batch()) == float(reference.train_batch(iter(step)))
    return scheduler.state_dict(), engine.global_steps


def test_a_pipeline_module_through_initialize():
    assert workers(2).run(pipeline_through_the_face) == [({"last_batch_iteration": 2}, 3)] * 2
