"""zfunc.deepspeed.client: a script's torch / DeepSpeed optimizer and lr scheduler read into zfunc's
train as the script's own objects do in a plain PyTorch loop (scheduler.step() after each
optimizer.step(), as DeepSpeed's engine calls it), to 1e-6 in fp32; what has no counterpart is
refused by name."""
from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as ls

import zfunc as zf
from models import batch, build, local, loss
from workers import workers
from zfunc.deepspeed.client import optimizer_from_client, schedule_from_client
from zfunc.testing import assert_trees_all_close

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 6
RTOL = 1e-6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)


def no_decay(name: str) -> bool:
    return name.endswith("bias") or "norm" in name or ".ln" in name or name.startswith("ln")


def hf_groups(model, weight_decay=0.1, lr_rest=None):
    """Hugging Face Trainer's / DeepSpeedExamples' two groups: decay on weights, none on biases and norms."""
    rest = {"params": [p for n, p in model.named_parameters() if no_decay(n)], "weight_decay": 0.0}
    if lr_rest is not None:
        rest["lr"] = lr_rest
    return [{"params": [p for n, p in model.named_parameters() if not no_decay(n)], "weight_decay": weight_decay},
            rest]


# DeepSpeed's FusedAdam and DeepSpeedCPUAdam build a native op in their constructor (a CUDA or a
# C++ build); these stand-ins keep what zfunc reads: the class name, the constructor's defaults
# and param-group keys and the mode attribute (deepspeed/ops/adam/fused_adam.py, cpu_adam.py, 0.19.8).
class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = 1 if adam_w_mode else 0


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                            bias_correction=bias_correction, amsgrad=amsgrad))
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states


def same_math(opt):
    """The torch optimizer that does what a DeepSpeed stand-in's step does (torch's AdamW / Adam)."""
    name = type(opt).__name__
    if name not in ("FusedAdam", "DeepSpeedCPUAdam"):
        return opt
    cls = torch.optim.AdamW if opt.adam_w_mode else torch.optim.Adam
    groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
              for g in opt.param_groups]
    return cls(groups)


OPTIMIZERS = {
    "adamw_groups": lambda m: torch.optim.AdamW(hf_groups(m, lr_rest=3e-2), lr=1e-2, betas=(0.85, 0.99)),
    "adam": lambda m: torch.optim.Adam(hf_groups(m, weight_decay=0.05), lr=1e-2, eps=1e-6),
    "adam_decoupled": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                 decoupled_weight_decay=True),
    "sgd_groups": lambda m: torch.optim.SGD([{"params": hf_groups(m)[0]["params"], "momentum": 0.9, "nesterov": True},
                                             {"params": hf_groups(m)[1]["params"], "weight_decay": 0.01}],
                                            lr=0.05, momentum=0.5),
    "fused_adam": lambda m: FusedAdam(hf_groups(m), lr=1e-2),
    "fused_adam_l2": lambda m: FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.05, adam_w_mode=False),
    "cpu_adam": lambda m: DeepSpeedCPUAdam(hf_groups(m, lr_rest=2e-2), lr=1e-2),
}


def ds_schedules():
    from deepspeed.runtime import lr_schedules as ds

    return ds


SCHEDULERS = {
    "none": None,
    "lambda_warmup_decay": lambda o: ls.LambdaLR(o, lambda k: min((k + 1) / 3, max(0.0, (8 - k) / 5))),
    "step": lambda o: ls.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: ls.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
    "one_cycle": lambda o: ls.OneCycleLR(o, max_lr=[2e-2, 5e-2], total_steps=STEPS + 1),
    "linear": lambda o: ls.LinearLR(o, start_factor=0.2, total_iters=3),
    "sequential": lambda o: ls.SequentialLR(o, [ls.LinearLR(o, start_factor=0.1, total_iters=2),
                                                ls.CosineAnnealingLR(o, T_max=4)], milestones=[2]),
    "ds_warmup": lambda o: ds_schedules().WarmupLR(o, warmup_min_lr=1e-4, warmup_max_lr=2e-2, warmup_num_steps=4),
    "ds_warmup_decay": lambda o: ds_schedules().WarmupDecayLR(o, total_num_steps=8, warmup_max_lr=2e-2,
                                                              warmup_num_steps=3, warmup_type="linear"),
    "ds_warmup_cosine": lambda o: ds_schedules().WarmupCosineLR(o, total_num_steps=8, warmup_num_steps=3),
    "ds_one_cycle": lambda o: ds_schedules().OneCycle(o, cycle_min_lr=1e-3, cycle_max_lr=2e-2,
                                                      cycle_first_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9),
}


def grads_for(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(STEPS)]


def run_pair(opt_name, sched_name, callable_form=False):
    """The script's objects stepped by hand over fixed gradients, and the zfunc optimizer read from
    them (before the script steps them: zfunc reads a private copy) over the same gradients."""
    model = Net()
    client = OPTIMIZERS[opt_name](model)
    make = SCHEDULERS[sched_name]
    sched_arg = sched = None
    if make is not None:
        if callable_form:
            sched_arg = make  # deepspeed.initialize's lr_scheduler=lambda optimizer: scheduler
        else:
            sched_arg = sched = make(client)
    ours = optimizer_from_client(client, model, lr_scheduler=sched_arg)
    lr0 = None if make is None else schedule_from_client(sched_arg, client)
    if callable_form and make is not None:
        sched = make(client)
    stepper = same_math(client)
    grads = grads_for(model)
    lrs = []
    for g in grads:
        lrs.append(client.param_groups[0]["lr"])
        if stepper is not client:  # the stand-in's groups, as its scheduler left them
            for a, b in zip(stepper.param_groups, client.param_groups):
                a.update({k: b[k] for k in ("lr", "betas") if k in b})
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
        stepper.step()
        if sched is not None:
            sched.step()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    tree = {n: p.clone() for n, p in Net().named_parameters()}
    state = ours.init(tree)
    for g in grads:
        tree, state = ours.update({n: x.clone() for n, x in g.items()}, state, tree)
    return tree, expected, lrs, lr0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # a stand-in's twin steps
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_each_optimizer_with_a_schedule(opt_name):
    got, expected, lrs, lr0 = run_pair(opt_name, "lambda_warmup_decay")
    assert_trees_all_close(got, expected, rtol=RTOL, atol=1e-7)
    assert [lr0(k) for k in range(STEPS)] == pytest.approx(lrs, rel=1e-12)


@pytest.mark.parametrize("sched_name", [s for s in SCHEDULERS if s != "lambda_warmup_decay"])
def test_each_scheduler_with_adamw_groups(sched_name):
    got, expected, lrs, lr0 = run_pair("adamw_groups", sched_name)
    assert_trees_all_close(got, expected, rtol=RTOL, atol=1e-7)
    if lr0 is not None:
        assert [lr0(k) for k in range(STEPS)] == pytest.approx(lrs, rel=1e-12)
        assert len(set(lrs)) > 1 or sched_name == "none"  # the schedule moves


def test_a_scheduler_that_cycles_momentum_drives_sgd_momentum():
    """(DeepSpeed's OneCycle cycles Adam's betas only, tested above with AdamW.)"""
    got, expected, _, _ = run_pair("sgd_groups", "one_cycle")
    assert_trees_all_close(got, expected, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("sched_name", ["step", "one_cycle"])
def test_a_callable_scheduler(sched_name):
    got, expected, lrs, lr0 = run_pair("adamw_groups", sched_name, callable_form=True)
    assert_trees_all_close(got, expected, rtol=RTOL, atol=1e-7)
    assert [lr0(k) for k in range(STEPS)] == pytest.approx(lrs, rel=1e-12)


def test_the_client_objects_are_left_as_they_were():
    model = Net()
    client = OPTIMIZERS["adamw_groups"](model)
    sched = SCHEDULERS["cosine"](client)
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in client.param_groups]
    ours = optimizer_from_client(client, model, lr_scheduler=sched)
    ours.lr(5)  # the private copy steps five times
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in client.param_groups] == before
    assert sched.last_epoch == 0


def test_schedule_from_the_config_lr_for_a_callable():
    """The config builds the optimizer: the callable is given a stand-in with the config's lr."""
    lr = schedule_from_client(lambda o: ls.StepLR(o, step_size=2, gamma=0.1), 0.5)
    assert [lr(k) for k in range(5)] == pytest.approx([0.5, 0.5, 0.05, 0.05, 0.005])
    assert schedule_from_client(lambda o: ls.LambdaLR(o, lambda k: 1 / (k + 1)), 2.0)(3) == pytest.approx(0.5)


def test_what_has_no_counterpart_is_refused_by_name():
    model = Net()
    with pytest.raises(TypeError, match=r"builtins\.object, which zfunc cannot read"):
        optimizer_from_client(object(), model)

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match="a subclass of AdamW whose step may differ"):
        optimizer_from_client(MyAdamW(model.parameters()), model)
    with pytest.raises(ValueError, match="AdamW param group 0 sets amsgrad=True"):
        optimizer_from_client(torch.optim.AdamW(model.parameters(), amsgrad=True), model)
    with pytest.raises(ValueError, match="SGD param group 0 sets maximize=True"):
        optimizer_from_client(torch.optim.SGD(model.parameters(), lr=0.1, maximize=True), model)
    with pytest.raises(ValueError, match="FusedAdam param group 0 sets bias_correction=False"):
        optimizer_from_client(FusedAdam(model.parameters(), bias_correction=False), model)
    with pytest.raises(ValueError, match="fp32_optimizer_states=False.*state_dtype=torch.bfloat16"):
        optimizer_from_client(DeepSpeedCPUAdam(model.parameters(), fp32_optimizer_states=False), model)
    with pytest.raises(ValueError, match="differ in decoupled_weight_decay"):
        optimizer_from_client(torch.optim.Adam([{"params": [model.fc1.weight], "decoupled_weight_decay": True},
                                                {"params": [p for n, p in model.named_parameters()
                                                            if n != "fc1.weight"]}]), model)
    with pytest.raises(ValueError, match=r"\['fc2.weight', 'fc2.bias'\] \(2 in all\) are in no param group"):
        optimizer_from_client(torch.optim.AdamW([*model.fc1.parameters(), *model.norm.parameters()]), model)
    model.fc2.requires_grad_(False)  # frozen, as torch would leave them: accepted
    optimizer_from_client(torch.optim.AdamW([*model.fc1.parameters(), *model.norm.parameters()]), model)
    with pytest.raises(ValueError, match=r"holds a parameter of shape \(8, 4\) that is not one of the model's"):
        optimizer_from_client(torch.optim.AdamW(Net().parameters()), model)


def test_schedulers_zfunc_cannot_follow_are_refused_by_name():
    model = Net()
    client = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="ReduceLROnPlateau: its lr follows the metric"):
        optimizer_from_client(client, model, lr_scheduler=ls.ReduceLROnPlateau(client))
    with pytest.raises(ValueError, match="built on another optimizer"):
        optimizer_from_client(client, model, lr_scheduler=ls.StepLR(torch.optim.AdamW(model.parameters()), 2))
    with pytest.raises(TypeError, match="returned a float, not a scheduler built on that optimizer"):
        optimizer_from_client(client, model, lr_scheduler=lambda o: 0.1)
    with pytest.raises(TypeError, match="builtins.dict, which zfunc cannot follow"):
        optimizer_from_client(client, model, lr_scheduler={"type": "WarmupLR"})
    with pytest.raises(TypeError, match="built on an optimizer zfunc was not given"):
        schedule_from_client(ls.StepLR(client, 2), 1e-3)


# ---------------------------------------------- in zfunc's training step, zero1-3, W = 1, 2


def client_objects(model, case: str):
    if case == "adamw_hf":  # the most common script: AdamW, no-decay groups, linear warmup then decay
        opt = torch.optim.AdamW(hf_groups(model, lr_rest=2e-3), lr=1e-3)
        return opt, ls.LambdaLR(opt, lambda k: min((k + 1) / 2, max(0.0, (10 - k) / 8)))
    opt = torch.optim.SGD(hf_groups(model), lr=1e-2, momentum=0.9)  # "sgd_one_cycle"
    return opt, ls.OneCycleLR(opt, max_lr=5e-2, total_steps=STEPS + 2)


def reference(case: str, batch_size: int) -> dict:
    model = build("gpt")
    opt, sched = client_objects(model, case)
    for i in range(STEPS):
        x, y = batch("gpt", model, i, batch_size)
        opt.zero_grad()
        loss("gpt", model(x), y).backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(case: str, stage: int, per_rank: int) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, twin = build("gpt"), build("gpt")
    opt, sched = client_objects(model, case)

    def loss_fn(params, b):
        x, y = b
        return loss("gpt", zf.apply(model, params, x), y)

    step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](
        zf.train_step(loss_fn, optimizer_from_client(opt, model, lr_scheduler=sched)))
    state = step.init(model)
    lrs = []
    for i in range(STEPS):
        state, metrics = step(state, local(batch("gpt", twin, i, per_rank * world), rank, world))
        lrs.append(metrics["lr"])
    return {"params": zf.gather_params(state), "lrs": lrs}


def check(results, expected, rtol=RTOL):
    scale = max(v.abs().max().item() for v in expected.values())
    for r in results:
        assert_trees_all_close(r["params"], expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_client_adamw_and_schedule_train_as_the_script_under_zero1_2_3(world):
    expected = reference("adamw_hf", 2 * world)
    for stage in (1, 2, 3):
        results = workers(world).run(train, "adamw_hf", stage, 2)
        check(results, expected)
        warm = [min((k + 1) / 2, max(0.0, (10 - k) / 8)) * 1e-3 for k in range(STEPS)]
        assert results[0]["lrs"] == pytest.approx(warm, rel=1e-12)


def test_client_sgd_with_one_cycle_momentum_under_zero3():
    expected = reference("sgd_one_cycle", 4)
    check(workers(2).run(train, "sgd_one_cycle", 3, 2), expected)


@pytest.mark.slow
def test_client_optimizers_at_three_ranks():
    for case in ("adamw_hf", "sgd_one_cycle"):
        expected = reference(case, 6)
        for stage in (1, 2, 3):
            check(workers(3).run(train, case, stage, 2), expected)


def test_warmup_reference_is_not_flat():
    """The lambda of the training test rises then falls, so a schedule read wrongly would show."""
    values = [min((k + 1) / 2, max(0.0, (10 - k) / 8)) for k in range(STEPS)]
    assert values[0] < values[1] and values[-1] < values[2] and not math.isclose(values[0], values[-1])


# ----------------------------------- Hugging Face models with the Trainer's groups and schedules


def hf_model(kind: str):
    import transformers
    from hf import gpt2_config, llama_config

    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(gpt2_config())
    if kind == "llama":
        return transformers.LlamaForCausalLM(llama_config())
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0))


def trainer_objects(model):
    """What transformers' Trainer builds (create_optimizer's two groups by get_decay_parameter_names,
    a warmup-then-cosine schedule), as DeepSpeed scripts copy it."""
    import transformers

    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
                             {"params": [p for n, p in model.named_parameters() if n not in decay],
                              "weight_decay": 0.0}], lr=2e-3)
    return opt, transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS + 2)


def hf_tokens(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, 50, (size, 8), generator=torch.Generator().manual_seed(step))


def hf_reference(kind: str, batch_size: int) -> dict:
    model = hf_model(kind)
    opt, sched = trainer_objects(model)
    for i in range(STEPS):
        x = hf_tokens(i, batch_size)
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def hf_train(kind: str, stage: int, per_rank: int) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = hf_model(kind)
    opt, sched = trainer_objects(model)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](
        zf.train_step(loss_fn, optimizer_from_client(opt, model, lr_scheduler=sched)))
    state = step.init(model)
    for i in range(STEPS):
        state, _ = step(state, hf_tokens(i, per_rank * world)[rank * per_rank: (rank + 1) * per_rank])
    return {"params": zf.gather_params(state)}


# docs/testing.md's fp32 equivalence for whole models: the part of an attention bias that feeds the
# keys has an exactly-zero true gradient (softmax is shift invariant), so its gradient is rounding
# noise in any reduction order, which Adam scales up to about lr
HF_RTOL = 1e-5


@pytest.mark.slow  # the fast sibling: test_client_adamw_and_schedule_train_as_the_script_under_zero1_2_3
@pytest.mark.parametrize("world", [1, 2, 3])
def test_hugging_face_families_at_each_world(world):
    """GPT-2 (its tied head by its first name), Llama, GPT-NeoX with the Trainer's objects."""
    for kind in ("gpt2", "llama", "gpt_neox"):
        expected = hf_reference(kind, 2 * world)
        for stage in (1, 2, 3):
            check(workers(world).run(hf_train, kind, stage, 2), expected, HF_RTOL)
