"""zf.optim.group: per-parameter hyperparameters equal torch.optim's param groups, on pytrees and
on a model's flat per-unit buffers under zero1-3, offload_cpu and offload_nvme at W = 1, 2 (3 slow)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import zfunc as zf
from models import batch, build, local, loss
from workers import workers
from zfunc.testing import assert_trees_all_close

STEPS = 4
RTOL = 1e-6


def no_decay(name: str) -> bool:
    """Hugging Face Trainer's and DeepSpeedExamples' split: biases and norms get no decay."""
    return name.endswith("bias") or ".ln" in name or name.startswith("ln")


# ------------------------------------------------------------------ on plain pytrees


def tree_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 5, generator=g), "b": torch.randn(5, generator=g),
              "ln": {"weight": torch.randn(5, generator=g), "bias": torch.randn(5, generator=g)}}
    grads = [{k: (torch.randn(v.shape, generator=g) if isinstance(v, torch.Tensor)
                  else {j: torch.randn(u.shape, generator=g) for j, u in v.items()}) for k, v in params.items()}
             for _ in range(STEPS)]
    return params, grads


def flat(tree):
    return [tree["w"], tree["b"], tree["ln"]["weight"], tree["ln"]["bias"]]


def torch_on_tree(make, params, grads):
    """``make(parameters) -> torch optimizer`` stepped over ``grads``; the parameters after."""
    ps = [torch.nn.Parameter(t.clone()) for t in flat(params)]
    opt = make(ps)
    for g in grads:
        for p, x in zip(ps, flat(g)):
            p.grad = x.clone()
        opt.step()
    return [p.detach() for p in ps]


def zfunc_on_tree(opt, params, grads):
    tree = {k: (v.clone() if isinstance(v, torch.Tensor) else {j: u.clone() for j, u in v.items()})
            for k, v in params.items()}
    state = opt.init(tree)
    for g in grads:
        tree, state = opt.update({k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in g.items()},
                                 state, tree)
    return flat(tree)


TREE_CASES = {
    "adamw_no_decay": (
        lambda ps: torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1e-2,
                                     weight_decay=0.1),
        zf.optim.adamw(1e-2, weight_decay=0.1, groups=[zf.optim.group(["b", "ln.weight", "ln.bias"], weight_decay=0.0)])),
    "adamw_lr_betas_eps": (
        lambda ps: torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "betas": (0.8, 0.9),
                                                           "eps": 1e-6}], lr=1e-2, weight_decay=0.05),
        zf.optim.adamw(1e-2, weight_decay=0.05, groups=[zf.optim.group(lambda n: n.startswith("ln."), lr=3e-2,
                                                                       betas=(0.8, 0.9), eps=1e-6)])),
    "adam_l2": (
        lambda ps: torch.optim.Adam([{"params": ps[:1], "weight_decay": 0.2}, {"params": ps[1:]}], lr=1e-2),
        zf.optim.adam(1e-2, groups=[zf.optim.group(["w"], weight_decay=0.2)])),
    "sgd_momentum": (
        lambda ps: torch.optim.SGD([{"params": ps[:1], "momentum": 0.9, "nesterov": True},
                                    {"params": ps[1:], "weight_decay": 0.01}], lr=0.1),
        zf.optim.sgd(0.1, groups=[zf.optim.group(["w"], momentum=0.9, nesterov=True),
                                  zf.optim.group(lambda n: n != "w", weight_decay=0.01)])),
}


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_groups_on_a_pytree_equal_torch_param_groups(case):
    make, opt = TREE_CASES[case]
    params, grads = tree_problem()
    expected = torch_on_tree(make, params, grads)
    got = zfunc_on_tree(opt, params, grads)
    assert_trees_all_close(got, expected, rtol=RTOL, atol=1e-7)


def test_a_scheduled_hyperparameter_is_read_at_each_update():
    """betas[0] as a schedule, as OneCycleLR cycles Adam's momentum: torch with the group's
    betas set before each step."""
    beta1 = lambda step: 0.95 - 0.05 * step  # noqa: E731
    lr = lambda step: 1e-2 * (step + 1)  # noqa: E731
    params, grads = tree_problem(1)
    ps = [torch.nn.Parameter(t.clone()) for t in flat(params)]
    opt = torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1.0, weight_decay=0.1)
    for k, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"], group["betas"] = lr(k), (beta1(k), 0.999)
        for p, x in zip(ps, flat(g)):
            p.grad = x.clone()
        opt.step()
    ours = zf.optim.adamw(lr, betas=(beta1, 0.999), weight_decay=0.1,
                          groups=[zf.optim.group(lambda n: n != "w", weight_decay=0.0)])
    assert_trees_all_close(zfunc_on_tree(ours, params, grads), [p.detach() for p in ps], rtol=RTOL, atol=1e-7)


def test_groups_change_the_result():
    """A test that could not fail otherwise: with and without the group, the parameters differ."""
    params, grads = tree_problem()
    with_groups = zfunc_on_tree(TREE_CASES["adamw_no_decay"][1], params, grads)
    without = zfunc_on_tree(zf.optim.adamw(1e-2, weight_decay=0.1), params, grads)
    assert not torch.equal(with_groups[1], without[1])
    assert torch.equal(with_groups[0], without[0])


def test_group_errors_name_what_is_wrong():
    params, grads = tree_problem()
    with pytest.raises(ValueError, match=r"parameter 'b' is selected by two groups"):
        zfunc_on_tree(zf.optim.adamw(1e-2, groups=[zf.optim.group(["b"], lr=0.1),
                                                   zf.optim.group(lambda n: n == "b", weight_decay=0.0)]),
                      params, grads)
    # the state's size per element, as offload reads it, from a one-leaf probe tree
    assert zf.optim.base.state_bytes_per_element(zf.optim.adamw(1e-2, groups=[zf.optim.group(["b"], lr=0.1)])) == 8
    with pytest.raises(TypeError, match="give a list of parameter names"):
        zf.optim.group("b", lr=0.1)
    with pytest.raises(TypeError, match="sets 'momentum', which adamw does not take"):
        zf.optim.adamw(1e-2, groups=[zf.optim.group(["b"], momentum=0.9)])
    with pytest.raises(ValueError, match=r"adamw: betas\[0\] must be in \[0, 1\), got 1.5"):
        zf.optim.adamw(1e-2, groups=[zf.optim.group(["b"], betas=(1.5, 0.9))])
    with pytest.raises(ValueError, match="sgd: nesterov=True needs momentum > 0"):
        zf.optim.sgd(0.1, groups=[zf.optim.group(["b"], nesterov=True)])
    with pytest.raises(TypeError, match="at least one hyperparameter"):
        zf.optim.group(["b"])
    with pytest.raises(ValueError, match="weight_decay must be >= 0, got -1"):  # a schedule checked when read
        zfunc_on_tree(zf.optim.adamw(1e-2, weight_decay=lambda step: -1.0), params, grads)


# ----------------------------------------------------------- on a model's flat buffers


LR_BIAS = 3e-3


def torch_groups(model, lr=1e-3):
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    rest = [p for n, p in model.named_parameters() if no_decay(n)]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": LR_BIAS}],
                             lr=lr, weight_decay=0.1)


def zfunc_groups(lr=1e-3, names_of=None):
    """The groups by a predicate, or (``names_of``: a model) by the list of names it selects there,
    as client optimizers give them."""
    select = no_decay
    if names_of is not None:
        select = [n for n, _ in names_of.named_parameters() if no_decay(n)]
    return zf.optim.adamw(lr, weight_decay=0.1, groups=[zf.optim.group(select, weight_decay=0.0, lr=LR_BIAS)])


def reference(name: str, steps: int, batch_size: int, kw=None) -> dict:
    model = build(name, **(kw or {}))
    opt = torch_groups(model)
    for i in range(steps):
        x, y = batch(name, model, i, batch_size)
        opt.zero_grad()
        loss(name, model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(name: str, stage: int, steps: int, per_rank: int, offload: str | None = None, kw=None) -> dict:
    """``steps`` zfunc steps with the grouped AdamW on this rank's part of each global batch;
    ``offload``: ``"cpu"`` or ``"nvme"`` (the groups then by their names' list); ``kw``: the model's."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, twin = build(name, **(kw or {})), build(name, **(kw or {}))

    def loss_fn(params, b):
        x, y = b
        return loss(name, zf.apply(model, params, x), y)

    step = zf.train_step(loss_fn, zfunc_groups(names_of=twin if offload else None))
    if offload == "cpu":
        step = zf.offload_cpu(step)
    elif offload == "nvme":  # buffers smaller than the root unit: it is updated a piece at a time
        path = os.path.join(tempfile.gettempdir(), f"zfunc-groups-nvme-{os.getpid()}")
        step = zf.offload_nvme(step, path=path, buffer_size=1000)
    step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step)
    state = step.init(model)
    for i in range(steps):
        state, _ = step(state, local(batch(name, twin, i, per_rank * world), rank, world))
    return zf.gather_params(state)


def check(results, expected):
    scale = max(v.abs().max().item() for v in expected.values())
    for r in results:
        assert list(r) == list(expected)
        assert_trees_all_close(r, expected, rtol=RTOL, atol=RTOL * scale)


@pytest.mark.parametrize("world", [1, 2])
def test_model_groups_equal_torch_under_zero1_2_3(world):
    """gpt: biases and LayerNorms across units, the root unit, a tied head (by its first name)."""
    expected = reference("gpt", STEPS, 2 * world)
    for stage in (1, 2, 3):
        check(workers(world).run(train, "gpt", stage, STEPS, 2), expected)


def test_model_groups_equal_torch_under_offload_cpu():
    expected = reference("gpt", STEPS, 4)
    for stage in (2, 3):
        check(workers(2).run(train, "gpt", stage, STEPS, 2, "cpu"), expected)


def test_model_groups_equal_torch_under_offload_nvme_in_pieces():
    """The root unit (embedding, tied head) larger than a swap buffer: updated piece by piece, each
    piece's parameter ranges cut by group."""
    expected = reference("gpt", STEPS, 4, {"vocab": 1200})
    check(workers(2).run(train, "gpt", 3, STEPS, 2, "nvme", {"vocab": 1200}), expected)


def split_but_same(stage: int, composition: str) -> list:
    """Parameters and their bf16 copies after steps with groups that hold the optimizer's own values
    (each update is cut into parts, the math unchanged) and without groups."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    out = []
    for groups in ([zf.optim.group(no_decay, weight_decay=0.1, lr=1e-3)], []):
        model, twin = build("gpt"), build("gpt")

        def loss_fn(params, b):
            x, y = b
            return loss("gpt", zf.apply(model, params, x), y)

        step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.1, groups=groups)))
        if composition == "offload_cpu":
            step = zf.offload_cpu(step)
        step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step)
        state = step.init(model)
        for i in range(3):
            state, _ = step(state, local(batch("gpt", twin, i, 2 * world), rank, world))
        out.append({"params": [t.clone() for t in zf.pytree.tree_leaves(state.params)],
                    "master": [t.clone() for t in zf.pytree.tree_leaves(state.opt_state) if t.is_floating_point()]})
    return out


@pytest.mark.parametrize("stage, composition", [(1, "plain"), (3, "offload_cpu")])
def test_groups_cut_updates_without_changing_a_bit_under_bf16(stage, composition):
    """The bf16 copies written part by part (and the rest cast whole) equal those of one whole update."""
    for split, whole in workers(2).run(split_but_same, stage, composition):
        assert_trees_all_close(split, whole, rtol=0, atol=0)


def init_naming(name: str) -> str:
    """step.init with a group naming ``name``: the error's text."""
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: 0.0, zf.optim.adamw(1e-3, groups=[zf.optim.group([name], lr=0.1)])))
    try:
        step.init(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_model_group_names_are_checked():
    [tied] = workers(1).run(init_naming, "head.weight")
    assert "'head.weight', which is tied to 'tok.weight'" in tied
    [typo] = workers(1).run(init_naming, "blocks.0.qkv.bias")
    assert "names ['blocks.0.qkv.bias'], not parameters of the model" in typo


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "odd_mlp"])
def test_model_groups_equal_torch_at_three_ranks(name):
    """Shards that cut parameters apart at uneven places."""
    expected = reference(name, STEPS, 6)
    for stage in (1, 2, 3):
        check(workers(3).run(train, name, stage, STEPS, 2, False), expected)
    check(workers(3).run(train, name, 3, STEPS, 2, "cpu"), expected)
