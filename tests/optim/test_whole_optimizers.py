"""Whole-tensor optimizers (zf.optim.muon, adafactor, from_torch, multi) equal torch.optim's classes:
on plain tensors, and on a model's flat buffers at W = 1 replicated and under zero1/2/3."""
from __future__ import annotations

import pytest
import torch

import zfunc as zf
import zfunc.tree
from assertions import assert_close_to
from models import batch, build, local, loss
from workers import workers
from optim_reference import (ADAMW, MUON, problem, recipe_label, torch_on_tensors, torch_recipe, train_torch,
                             zfunc_on_tensors, zfunc_recipe)
from zfunc.testing import assert_trees_all_close

STEPS = 4
RTOL = 1e-5
MATRICES = [(6, 4), (3, 7), (5, 5)]


@pytest.mark.parametrize("kw", [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
                                {"momentum": 0.9, "ns_steps": 3}])
def test_muon_equals_torch_muon(kw):
    params, grads = problem(MATRICES, STEPS)
    want = torch_on_tensors(lambda ps: torch.optim.Muon(ps, lr=0.02, **kw), params, grads)
    got = zfunc_on_tensors(zf.optim.muon(0.02, **kw), params, grads)
    assert_trees_all_close(got, want, rtol=RTOL, atol=1e-7)


def test_adafactor_equals_torch_adafactor():
    shapes = MATRICES + [(5,), (2, 3, 4)]
    params, grads = problem(shapes, STEPS)
    for kw in ({}, {"weight_decay": 0.1, "d": 2.0}, {"eps": (1e-30, 1e-3), "beta2_decay": -0.5}):
        want = torch_on_tensors(lambda ps: torch.optim.Adafactor(ps, lr=0.05, **kw), params, grads)
        got = zfunc_on_tensors(zf.optim.adafactor(0.05, **kw), params, grads)
        assert_trees_all_close(got, want, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    (torch.optim.Adafactor, {"lr": 0.05}),
    (torch.optim.Muon, {"lr": 0.02}),
    (torch.optim.Adamax, {"lr": 0.01}),
])
def test_from_torch_equals_the_class_itself(cls, kw):
    shapes = MATRICES if cls is torch.optim.Muon else MATRICES + [(5,)]
    params, grads = problem(shapes, STEPS)
    want = torch_on_tensors(lambda ps: cls(ps, **kw), params, grads)
    got = zfunc_on_tensors(zf.optim.from_torch(cls, **kw), params, grads)
    assert_trees_all_close(got, want, rtol=RTOL, atol=1e-7)


def test_from_torch_keeps_the_fused_path_for_elementwise_classes():
    opt = zf.optim.from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    assert opt.defers  # zfunc's fused adamw, not the whole-tensor adapter
    params, grads = problem(MATRICES, STEPS)
    want = torch_on_tensors(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), params, grads)
    assert_trees_all_close(zfunc_on_tensors(opt, params, grads), want, rtol=RTOL, atol=1e-7)


def test_multi_equals_two_torch_optimizers_side_by_side():
    params, grads = problem(MATRICES + [(5,)], STEPS)
    label = lambda name: "muon" if name in ("p0", "p1") else "adamw"  # noqa: E731

    def make(ps):
        return [torch.optim.Muon(ps[:2], **MUON), torch.optim.AdamW(ps[2:], **ADAMW)]

    ps = [torch.nn.Parameter(t.clone()) for t in params]
    opts = make(ps)
    for g in grads:
        for p, x in zip(ps, g):
            p.grad = x.clone()
        for o in opts:
            o.step()
    opt = zf.optim.multi({"muon": zf.optim.muon(**MUON), "adamw": zf.optim.adamw(**ADAMW)}, label)
    got = zfunc_on_tensors(opt, params, grads)
    assert_trees_all_close(got, [p.detach() for p in ps], rtol=RTOL, atol=1e-7)


def test_errors_name_the_parameter_and_what_to_do():
    with pytest.raises(ValueError, match=r"muon: parameter 'b' has shape \(5,\); Muon updates 2-D matrices only"):
        zf.optim.muon(0.02).init({"w": torch.zeros(3, 4), "b": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"multi: parameter 'b' is labelled 'sgd', which names no optimizer"):
        zf.optim.multi({"muon": zf.optim.muon(0.02)}, lambda n: "sgd").init({"b": torch.zeros(5)})
    with pytest.raises(TypeError, match="give a torch.optim.Optimizer class"):
        zf.optim.from_torch(torch.nn.Linear)


# ------------------------------------------------------------ on a model's flat buffers, W = 1


def train(stage: int, steps: int, per_rank: int, opt_name: str = "recipe", ns_dtype=torch.bfloat16,
          dtype=torch.float32, shard: int | None = None, gather: bool = False) -> dict:
    """``shard``: hybrid sharding over a (W / shard) x shard mesh; ``gather``: no owner layout (the
    shards cut the matrices, whose units are gathered to their owners)."""
    padding = zfunc.tree.MAX_OWNER_PADDING
    zfunc.tree.MAX_OWNER_PADDING = -1.0 if gather else padding
    try:
        return _train(stage, steps, per_rank, opt_name, ns_dtype, dtype, shard)
    finally:
        zfunc.tree.MAX_OWNER_PADDING = padding


def _train(stage, steps, per_rank, opt_name, ns_dtype, dtype, shard) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model, twin = build("gpt").to(dtype), build("gpt").to(dtype)

    def loss_fn(params, b):
        x, y = b
        return loss("gpt", zf.apply(model, params, x), y)

    opt = {"recipe": lambda: zfunc_recipe(ns_dtype),
           "adafactor": lambda: zf.optim.adafactor(0.05),
           "rmsprop": lambda: zf.optim.from_torch(torch.optim.RMSprop, lr=1e-3, momentum=0.5)}[opt_name]()
    step = zf.train_step(loss_fn, opt)
    if stage:
        mesh = {} if shard is None else {"mesh": zf.dist.mesh(shard=shard)}
        step = {1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[stage](step, **mesh)
    state = step.init(model)
    for i in range(steps):
        state, _ = step(state, local(batch("gpt", twin, i, per_rank * world), rank, world))
    return zf.gather_params(state)


TORCH = {"recipe": torch_recipe,
         "adafactor": lambda m: [torch.optim.Adafactor(m.parameters(), lr=0.05)],
         "rmsprop": lambda m: [torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5)]}


@pytest.mark.parametrize("opt_name", list(TORCH))
def test_whole_tensor_optimizers_on_a_model_at_w1(opt_name):
    """Muon + AdamW (the recipe), Adafactor and RMSprop through from_torch on the GPT's flat buffers:
    replicated and under zero1/2/3 at W = 1, equal to torch's optimizers on the model itself."""
    expected = train_torch("gpt", TORCH[opt_name], STEPS, 4)
    for stage in (0, 1, 2, 3):
        assert_close_to(train(stage, STEPS, 4, opt_name), expected)


def test_recipe_labels_the_blocks_matrices():
    names = [n for n, _ in build("gpt").named_parameters()]
    muon = [n for n in names if recipe_label(n) == "muon"]
    assert muon and all(n.startswith("blocks.") for n in muon) and "tok.weight" not in muon


# ------------------------------------------------------------ W = 2, 3: owners


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_recipe_under_zero_at_w2_w3_equals_torch_in_fp64(world):
    """Muon + AdamW under zero1/2/3 on the global batch, fp64 with Newton-Schulz unrounded on both
    sides (torch's bf16 rounding turns the ranks' differently ordered gradient sums into bf16 ulps)."""
    expected = train_torch("gpt", torch_recipe, STEPS, 2 * world, dtype=torch.float64)
    for stage in (0, 1, 2, 3):
        for gather in (False, True):
            for got in workers(world).run(train, stage, STEPS, 2, "recipe", torch.float64, torch.float64, None, gather):
                assert_close_to(got, expected)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_adafactor_and_rmsprop_under_zero_at_w2_w3(world):
    for name in ("adafactor", "rmsprop"):
        expected = train_torch("gpt", TORCH[name], STEPS, 2 * world)
        for stage in (1, 2, 3):
            for gather in (False, True):
                for got in workers(world).run(train, stage, STEPS, 2, name, torch.bfloat16, torch.float32, None, gather):
                    assert_close_to(got, expected)


@pytest.mark.slow
def test_whole_tensor_optimizers_under_a_2x2_mesh():
    """Hybrid sharding (W = 4: two replicas of a 2-way shard group): owners within each shard group."""
    expected = train_torch("gpt", torch_recipe, STEPS, 8, dtype=torch.float64)
    for stage in (1, 3):
        for got in workers(4).run(train, stage, STEPS, 2, "recipe", torch.float64, torch.float64, 2):
            assert_close_to(got, expected)
    expected = train_torch("gpt", TORCH["adafactor"], STEPS, 8)
    for got in workers(4).run(train, 3, STEPS, 2, "adafactor", torch.bfloat16, torch.float32, 2):
        assert_close_to(got, expected)


def optimizer_bytes(opt_name: str) -> int:
    model = build("gpt")
    opt = {"recipe": zfunc_recipe, "adafactor": lambda: zf.optim.adafactor(0.05)}[opt_name]()
    step = zf.zero3(zf.train_step(lambda p, b: loss("gpt", zf.apply(model, p, b[0]), b[1]), opt))
    return zf.memory_report(step.init(model))["optimizer_bytes"]


def test_memory_report_shows_the_state_each_rank_holds():
    """Muon's momentum and AdamW's moments are sharded with the parameters (each rank about 1/W of
    them); Adafactor's factors are small and on every rank."""
    one = workers(1).run(optimizer_bytes, "recipe")[0]
    two = workers(2).run(optimizer_bytes, "recipe")
    params = sum(p.numel() for p in build("gpt").parameters())
    muon = sum(p.numel() for n, p in build("gpt").named_parameters() if recipe_label(n) == "muon")
    # AdamW's two moments over its parameters and Muon's momentum over its (and the step counts), not over all
    assert 4 * (2 * (params - muon) + muon) <= one < 4 * (2 * (params - muon) + muon) + 8 * 64
    assert all(b < 0.75 * one for b in two)  # half, and the owner layout's padding (blocks 848 -> 1104 elements)
    factors = workers(2).run(optimizer_bytes, "adafactor")
    assert factors[0] == factors[1] < 0.3 * one


def state_over_ideal() -> float:
    """This rank's optimizer state for the recipe under zero3 over the issue's aim: an even share of
    the ideal state (AdamW's 8 B per AdamW parameter, Muon's 4 B per matrix element) plus the largest
    matrix's momentum."""
    named = list(build("gpt").named_parameters())
    muon = [p.numel() for n, p in named if recipe_label(n) == "muon"]
    adamw = sum(p.numel() for n, p in named if recipe_label(n) != "muon")
    ideal = (8 * adamw + 4 * sum(muon)) / zf.dist.world_size() + 4 * max(muon)
    return optimizer_bytes("recipe") / ideal


def test_multi_holds_each_members_state_only_for_its_own_parameters():
    """The issue's aim: Muon + AdamW's state per rank within 1.3x of an even share plus the largest
    matrix (2.6x here at W = 2 while each member held its state over every parameter; each holds its
    own parameters' only now: zfunc.optim.held)."""
    assert max(workers(2).run(state_over_ideal)) <= 1.3


def _check_owner_offsets(sizes, whole, world, found):
    offsets, padded = found
    n = padded // world
    assert padded % world == 0 and offsets == sorted(offsets)
    ends = [o + s for o, s in zip(offsets, sizes)]
    assert all(a >= b for a, b in zip(offsets[1:], ends))  # in order, never overlapping
    assert ends[-1] <= padded
    for o, s, w in zip(offsets, sizes, whole):
        if w and s:
            assert o // n == (o + s - 1) // n  # inside one shard


def test_owner_offsets_keep_each_whole_parameter_inside_one_shard():
    sizes, whole = [16, 192, 24, 64, 8, 256, 32, 256, 8], [False, True, False, True, False, True, False, True, False]
    for world in (2, 3, 4):
        _check_owner_offsets(sizes, whole, world, zfunc.tree.owner_offsets(sizes, whole, world))
        load = [0.0] * world
        costs = [float(s) ** 1.5 if w else 0.0 for s, w in zip(sizes, whole)]
        _check_owner_offsets(sizes, whole, world, zfunc.tree.owner_offsets(sizes, whole, world, costs, load))
        assert sum(load) == sum(costs)  # this unit's costs added to the ranks'
    assert zfunc.tree.owner_offsets([5, 7], [False, False], 2) is None


def test_owner_offsets_balanced_by_cost_on_random_units():
    """The balanced layout keeps the constraints on any unit (random sizes, empty entries, a whole
    entry as large as a shard), and is the same every time (every rank lays it out alike)."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        world, k = rng.randint(2, 8), rng.randint(1, 12)
        sizes = [rng.choice([0, 1, 3, 8, 17, 64, 100]) for _ in range(k)]
        whole = [rng.random() < 0.6 for _ in range(k)]
        if not any(whole):
            continue
        costs = [float(s * s) if w else 0.0 for s, w in zip(sizes, whole)]
        load = [float(rng.randint(0, 500)) for _ in range(world)]
        again = list(load)
        found = zfunc.tree.owner_offsets(sizes, whole, world, costs, load)
        _check_owner_offsets(sizes, whole, world, found)
        assert zfunc.tree.owner_offsets(sizes, whole, world, costs, again) == found and again == load


class _Block(torch.nn.Module):
    """A GPT block's parameters, in examples/gpt.py's order (pre-LN, biases, 4x MLP)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)


class _GPTShapes(torch.nn.Module):
    def __init__(self, layers: int, d: int, vocab: int = 512):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab, bias=False)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(layers))


def _matrix(name: str) -> bool:
    return name.startswith("blocks.") and name.endswith(".weight") and ".ln" not in name


def owner_loads(layers: int, d: int, world: int, balanced: bool = True):
    """Each rank's Newton-Schulz FLOPs for the recipe on a GPT's shapes (meta tensors), the largest
    single matrix's, and the spec."""
    from zfunc.optim import owners
    from zfunc.optim.muon import ns_flops
    from zfunc.optim.whole import whole_params

    with torch.device("meta"):
        model = _GPTShapes(layers, d)
    opt = zf.optim.multi({"muon": zf.optim.muon(0.02), "adamw": zf.optim.adamw(1e-3)},
                         lambda n: "muon" if _matrix(n) else "adamw")
    kept = zfunc.tree.BALANCE_MAX_ENTRIES
    zfunc.tree.BALANCE_MAX_ENTRIES = kept if balanced else -1  # -1: in order, compactly (the layout before)
    try:
        spec = zfunc.tree.build_spec(model, None, world, whole=whole_params(opt))
    finally:
        zfunc.tree.BALANCE_MAX_ENTRIES = kept
    units = [[(k, e.name, e.shape, e.offset, e.offset + e.numel) for k, e in enumerate(u.trainable.entries)
              if _matrix(e.name)] for u in spec.units]
    placed = owners.assign(units, [u.trainable.padded // world for u in spec.units], world, ns_flops)
    largest = max(ns_flops(p.shape) for n, p in model.named_parameters() if _matrix(n))
    return owners.loads(placed, world, ns_flops), largest, spec, placed


@pytest.mark.parametrize("layers,d", [(4, 256), (12, 64), (24, 128)])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_owners_are_balanced_by_newton_schulz_flops(layers, d, world):
    """The owner layout puts each block's matrices in the shards of the ranks with the least
    Newton-Schulz work so far (zfunc.tree._balance): the busiest rank has at most the mean and one
    matrix more; every matrix still lies inside its owner's shard, in order."""
    loads, largest, spec, placed = owner_loads(layers, d, world)
    assert max(loads) <= sum(loads) / world + largest
    if world < 8:  # (at W = 8 a block's four matrices cannot share 8 shards cheaply: the gathered fallback)
        assert not any(p.cut for unit in placed for p in unit)
    for u, unit in zip(spec.units, placed):
        seg = u.trainable
        ends = [e.offset + e.numel for e in seg.entries]
        assert all(e.offset >= b for e, b in zip(seg.entries[1:], ends))  # in order, never overlapping
        assert seg.padded % world == 0 and seg.numel <= seg.padded
        n = seg.padded // world
        if not any(p.cut for p in unit):  # the owner layout: every matrix inside one shard
            assert all(e.offset // n == (e.offset + e.numel - 1) // n for e in seg.entries if _matrix(e.name))


def test_balancing_by_cost_beats_balancing_by_elements_at_little_padding():
    """The benchmark's GPT (4 blocks, d_model 256) at W = 4: laid out in order by elements the
    busiest rank had 6.04 GFLOP and the idlest 2.01; by cost it is within 12% of the mean, for about
    1.5% more padding."""
    by_elements, largest, old, _ = owner_loads(4, 256, 4, balanced=False)
    by_cost, _, new, _ = owner_loads(4, 256, 4)
    assert max(by_cost) < max(by_elements) and min(by_cost) > min(by_elements)
    assert max(by_cost) <= 1.12 * sum(by_cost) / 4
    padded = lambda spec: sum(u.trainable.padded for u in spec.units)
    assert padded(new) <= 1.02 * padded(old)


def step_comm(opt_name: str, gather: bool = False) -> dict:
    """The collectives of the second zero3 step (calls per kind), and the units' layouts."""
    padding = zfunc.tree.MAX_OWNER_PADDING
    zfunc.tree.MAX_OWNER_PADDING = -1.0 if gather else padding
    try:
        rank, world = zf.dist.rank(), zf.dist.world_size()
        model, twin = build("gpt"), build("gpt")
        opt = zfunc_recipe() if opt_name == "recipe" else zf.optim.adamw(**ADAMW)
        step = zf.zero3(zf.train_step(lambda p, b: loss("gpt", zf.apply(model, p, b[0]), b[1]), opt))
        state = step.init(model)
        for i in range(2):
            state, metrics = step(state, local(batch("gpt", twin, i, 2 * world), rank, world))
        return {kind: c["calls"] for kind, c in metrics["comm"]["world"].items()}
    finally:
        zfunc.tree.MAX_OWNER_PADDING = padding


def test_owner_layout_needs_no_collective_of_its_own_and_the_fallback_is_counted():
    """With shards cut at the matrices' boundaries, Muon + AdamW's zero3 step issues the same
    collectives as AdamW's (the reduce-scatter hands each owner its whole gradients, the usual
    all-gather brings the updates back); without that layout each block's unit is gathered to the
    owners: one more all-gather and all-reduce per block, counted in metrics["comm"]."""
    adamw = workers(2).run(step_comm, "adamw")[0]
    assert workers(2).run(step_comm, "recipe")[0] == adamw
    fallback = workers(2).run(step_comm, "recipe", True)[0]
    blocks = 2
    assert fallback["all_gather"] == adamw["all_gather"] + blocks
    assert fallback["all_reduce"] == adamw["all_reduce"] + blocks
