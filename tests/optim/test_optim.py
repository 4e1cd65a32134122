"""zfunc.optim against torch.optim: same numbers over many steps, on pytrees."""
from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.optim.lr_scheduler import LambdaLR

import zfunc.ops.adam
from zfunc import optim
from zfunc.pytree import global_norm, register_node, tree_leaves, tree_map, tree_structure
from zfunc.testing import assert_trees_all_close, assert_trees_all_equal, assert_trees_all_equal_structs

STEPS = 12
RTOL, ATOL = 1e-6, 1e-7

dims = st.sampled_from([1, 2, 3, 5, 7])
leaf_shapes = st.lists(st.lists(dims, max_size=3).map(tuple), min_size=1, max_size=5)
SCHEDULES = {
    "float": None,
    "warmup_cosine": optim.warmup_cosine_decay(1e-4, 3e-2, warmup_steps=3, decay_steps=10, end_value=1e-3),
    "linear": optim.linear_schedule(2e-2, 1e-3, transition_steps=8, transition_begin=2),
}
schedule_names = st.sampled_from(sorted(SCHEDULES))
FLOAT_LR = 1e-2
settings_ = settings(max_examples=15, deadline=None)


def build_tree(leaves):
    """Nested dicts, tuples and lists around the leaves."""
    head, *rest = leaves
    half = len(rest) // 2
    return {"embed": {"weight": head}, "blocks": (tuple(rest[:half]), [*rest[half:]])}


def make_problem(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    return params, grads


def run_torch(make_opt, params, grads_seq, *, schedule=None, max_norm=None):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make_opt(ps, 1.0 if schedule else FLOAT_LR)
    sched = LambdaLR(opt, schedule) if schedule else None
    for grads in grads_seq:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ps, max_norm)
        opt.step()
        if sched:
            sched.step()
    return build_tree([p.detach() for p in ps])


def run_zfunc(opt, params, grads_seq):
    tree = build_tree([p.clone() for p in params])
    state = opt.init(tree)
    for grads in grads_seq:
        tree, state = opt.update(build_tree([g.clone() for g in grads]), state, tree)
    return tree, state


def lr_of(schedule_name):
    return SCHEDULES[schedule_name] or FLOAT_LR


# ------------------------------------------------------------ against torch.optim


@settings_
@given(leaf_shapes, schedule_names, st.sampled_from([0.0, 0.01, 0.3]), st.sampled_from([(0.9, 0.999), (0.8, 0.95)]))
def test_adamw_matches_torch(shapes, sched_name, weight_decay, betas):
    params, grads = make_problem(shapes)
    ours, state = run_zfunc(optim.adamw(lr_of(sched_name), betas=betas, weight_decay=weight_decay), params, grads)
    ref = run_torch(
        lambda ps, lr: torch.optim.AdamW(ps, lr=lr, betas=betas, weight_decay=weight_decay),
        params, grads, schedule=SCHEDULES[sched_name],
    )
    assert_trees_all_close(ours, ref, rtol=RTOL, atol=ATOL)
    assert int(state.count) == STEPS


@settings_
@given(leaf_shapes, schedule_names, st.sampled_from([0.0, 0.05]), st.sampled_from([1e-8, 1e-3]))
def test_adam_matches_torch(shapes, sched_name, weight_decay, eps):
    params, grads = make_problem(shapes, seed=1)
    ours, _ = run_zfunc(optim.adam(lr_of(sched_name), eps=eps, weight_decay=weight_decay), params, grads)
    ref = run_torch(
        lambda ps, lr: torch.optim.Adam(ps, lr=lr, eps=eps, weight_decay=weight_decay),
        params, grads, schedule=SCHEDULES[sched_name],
    )
    assert_trees_all_close(ours, ref, rtol=RTOL, atol=ATOL)


sgd_configs = st.sampled_from([
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.1),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.5, nesterov=True, weight_decay=0.01),
    dict(momentum=0.0, weight_decay=0.1),
    dict(momentum=0.9, weight_decay=0.1, dampening=0.5),
])


@settings_
@given(leaf_shapes, schedule_names, sgd_configs)
def test_sgd_matches_torch(shapes, sched_name, config):
    params, grads = make_problem(shapes, seed=2)
    ours, state = run_zfunc(optim.sgd(lr_of(sched_name), **config), params, grads)
    ref = run_torch(lambda ps, lr: torch.optim.SGD(ps, lr=lr, **config), params, grads, schedule=SCHEDULES[sched_name])
    assert_trees_all_close(ours, ref, rtol=RTOL, atol=ATOL)
    assert (state.momentum is None) == (config["momentum"] == 0.0)


@settings_
@given(
    leaf_shapes,
    schedule_names,
    st.sampled_from([0.05, 1.0, 1e3]),
    st.sampled_from(["adamw", "adam", "sgd"]),
)
def test_chain_clip_matches_torch_clip_grad_norm(shapes, sched_name, max_norm, name):
    params, grads = make_problem(shapes, seed=3)
    ours_opt, torch_opt = {
        "adamw": (optim.adamw, lambda ps, lr: torch.optim.AdamW(ps, lr=lr)),
        "adam": (lambda lr: optim.adam(lr, weight_decay=0.01),
                 lambda ps, lr: torch.optim.Adam(ps, lr=lr, weight_decay=0.01)),
        "sgd": (lambda lr: optim.sgd(lr, momentum=0.9), lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)),
    }[name]
    opt = optim.chain(optim.clip_by_global_norm(max_norm), ours_opt(lr_of(sched_name)))
    assert isinstance(opt, optim.Optimizer)
    ours, state = run_zfunc(opt, params, grads)
    ref = run_torch(torch_opt, params, grads, schedule=SCHEDULES[sched_name], max_norm=max_norm)
    assert_trees_all_close(ours, ref, rtol=RTOL, atol=ATOL)
    assert isinstance(state, tuple) and len(state) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_cuda_matches_torch(name):
    params, grads = make_problem([(33, 7), (5,), ()], seed=7)
    params = [p.cuda() for p in params]
    grads = [[g.cuda() for g in gs] for gs in grads]
    ours_opt, torch_opt = {
        "adamw": (optim.adamw(FLOAT_LR), lambda ps, lr: torch.optim.AdamW(ps, lr=lr)),
        "sgd": (optim.sgd(FLOAT_LR, momentum=0.9, nesterov=True),
                lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True)),
    }[name]
    ours, _ = run_zfunc(optim.chain(optim.clip_by_global_norm(0.5), ours_opt), params, grads)
    ref = run_torch(torch_opt, params, grads, max_norm=0.5)
    assert all(x.is_cuda for x in tree_leaves(ours))
    assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- clipping


def test_clip_by_global_norm_scales_to_max_norm():
    clip = optim.clip_by_global_norm(1.0)
    state = clip.init(None)
    for i in range(1, 51):  # optax's check: the clipped norm is min(max_norm, norm)
        grads = {"a": torch.full((3,), 1.0 / i), "b": [torch.full((2, 2), float(i))]}
        norm = float(global_norm(grads))
        clipped, state = clip.update(grads, state)
        assert math.isclose(float(global_norm(clipped)), min(1.0, norm), rel_tol=1e-5)
        assert_trees_all_equal_structs(clipped, grads)


def test_clip_leaves_small_updates_unchanged():
    grads = {"a": torch.tensor([0.1, -0.2]), "b": torch.tensor(0.05)}
    expected = tree_map(torch.clone, grads)
    clipped, _ = optim.clip_by_global_norm(10.0).update(grads, optim.EmptyState())
    assert_trees_all_equal(clipped, expected)


# ------------------------------------------------------------- fused entry point


def test_adam_family_goes_through_one_fused_call(monkeypatch):
    calls = []
    real = zfunc.ops.adam.adam_update_

    def counting(params, *args, **kw):
        calls.append((len(params), kw["decoupled"], kw["step"]))
        return real(params, *args, **kw)

    monkeypatch.setattr(zfunc.ops.adam, "adam_update_", counting)
    params, grads = make_problem([(3, 2), (5,), (), (1, 7)])
    for make, decoupled in ((optim.adamw, True), (optim.adam, False)):
        calls.clear()
        run_zfunc(make(1e-3), params, grads)
        assert calls == [(4, decoupled, k + 1) for k in range(STEPS)]


def test_adamw_keeps_fp32_moments_for_low_precision_params(monkeypatch):
    calls = []
    real = zfunc.ops.adam.adam_update_

    def counting(params, *args, **kw):
        calls.append(sorted(str(p.dtype) for p in params))
        return real(params, *args, **kw)

    monkeypatch.setattr(zfunc.ops.adam, "adam_update_", counting)
    gen = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(4, 3, generator=gen), "h": torch.randn(6, generator=gen).bfloat16()}
    grads = {"w": torch.randn(4, 3, generator=gen), "h": torch.randn(6, generator=gen).bfloat16()}
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    assert state.mu["h"].dtype == torch.float32 and state.nu["h"].dtype == torch.float32
    # Reference: one fp32 AdamW step on an fp32 copy, rounded back to bf16.
    ref = torch.nn.Parameter(params["h"].float())
    ref.grad = grads["h"].float()
    torch.optim.AdamW([ref], lr=1e-2).step()
    new, state = opt.update(grads, state, params)
    assert calls == [["torch.bfloat16", "torch.float32"]]  # still one call
    assert new["h"].dtype == torch.bfloat16
    assert_trees_all_equal(new["h"], ref.detach().bfloat16())


# ---------------------------------------------------------- state and protocol


def test_update_returns_params_and_explicit_state():
    params, grads = make_problem([(2, 3), (1,)])
    tree = build_tree([p.clone() for p in params])
    opt = optim.adamw(1e-3)
    state = opt.init(tree)
    assert state.count.dtype == torch.int64 and state.count.device.type == "cpu" and state.count.ndim == 0
    assert tree_structure(state.mu) == tree_structure(tree) == tree_structure(state.nu)
    new, new_state = opt.update(build_tree(grads[0]), state, tree)
    assert tree_structure(new) == tree_structure(tree)
    assert int(new_state.count) == 1
    # Donation: the returned params are the updated input tensors, no second copy.
    assert all(a is b for a, b in zip(tree_leaves(new), tree_leaves(tree)))
    assert not torch.equal(new["embed"]["weight"], params[0])


def test_state_survives_torch_save_and_resumes_identically():
    params, grads = make_problem([(3, 3), (2,)], seed=5)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay(1e-2, 20)))
    straight, _ = run_zfunc(opt, params, grads)

    tree = build_tree([p.clone() for p in params])
    state = opt.init(tree)
    for g in grads[:5]:
        tree, state = opt.update(build_tree([x.clone() for x in g]), state, tree)
    buf = io.BytesIO()
    torch.save((tree, state), buf)
    buf.seek(0)
    tree, state = torch.load(buf, weights_only=False)
    for g in grads[5:]:
        tree, state = opt.update(build_tree([x.clone() for x in g]), state, tree)
    assert_trees_all_equal(tree, straight)


class Shards:
    """Stand-in for a custom parameter node: two flat 1-D leaves."""

    def __init__(self, a, b):
        self.a, self.b = a, b


register_node(Shards, lambda n: ((n.a, n.b), None), lambda aux, children: Shards(*children))


@pytest.mark.parametrize("make", [lambda: optim.adamw(1e-2), lambda: optim.sgd(1e-2, momentum=0.9)])
def test_custom_nodes_are_seen_through(make):
    gen = torch.Generator().manual_seed(6)
    flat = [torch.randn(7, generator=gen), torch.randn(1, generator=gen)]
    g = [torch.randn(7, generator=gen), torch.randn(1, generator=gen)]
    opt = make()
    params = {"unit": Shards(*[x.clone() for x in flat])}
    state = opt.init(params)
    assert isinstance(tree_leaves(state, is_leaf=lambda x: isinstance(x, Shards))[1], Shards)
    new, _ = opt.update({"unit": Shards(*[x.clone() for x in g])}, state, params)
    plain = {"unit": tuple(x.clone() for x in flat)}
    ref, _ = opt.update({"unit": tuple(x.clone() for x in g)}, opt.init(plain), plain)
    assert_trees_all_equal(tree_leaves(new), tree_leaves(ref))


def test_chain_composition_rules():
    clip = optim.clip_by_global_norm(1.0)
    assert isinstance(optim.chain(clip, clip), optim.GradientTransformation)
    assert isinstance(optim.chain(optim.chain(clip), optim.adamw(1e-3)), optim.Optimizer)
    assert isinstance(optim.chain(clip, optim.chain(clip, optim.sgd(0.1))), optim.Optimizer)
    with pytest.raises(TypeError, match="must come last"):
        optim.chain(optim.adamw(1e-3), clip)
    with pytest.raises(TypeError, match="not a GradientTransformation"):
        optim.chain(clip, (lambda p: None, lambda *a: None))
    ident = optim.chain()
    g = {"a": torch.ones(2)}
    out, state = ident.update(g, ident.init(g))
    assert out is g and state == ()


def test_mismatched_grads_give_clear_errors():
    opt = optim.adamw(1e-3)
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    state = opt.init(params)
    with pytest.raises(ValueError, match="grads does not have the structure of params"):
        opt.update({"a": torch.zeros(2)}, state, params)
    with pytest.raises(ValueError, match=r"grads\['b'\] has shape \(4,\)"):
        opt.update({"a": torch.zeros(2), "b": torch.zeros(4)}, state, params)


def test_argument_validation():
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        optim.adamw(1e-3, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        optim.adam(-1.0)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(0.0)


@pytest.mark.parametrize("make", ["adamw", "sgd"])
def test_none_gradient_leaves_a_leaf_untouched_like_torch(make):
    """A None gradient: no update, no decay, moments and the leaf's step count kept, as
    torch.optim skips a parameter whose .grad is None (its bias correction later too)."""
    params, grads_seq = make_problem([(3, 2), (4,)], seed=3)
    ours = optim.adamw(FLOAT_LR) if make == "adamw" else optim.sgd(FLOAT_LR, momentum=0.9, dampening=0.1)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    theirs = (torch.optim.AdamW(ps, lr=FLOAT_LR) if make == "adamw"
              else torch.optim.SGD(ps, lr=FLOAT_LR, momentum=0.9, dampening=0.1))
    tree = [p.clone() for p in params]
    state = ours.init(tree)
    for i, grads in enumerate(grads_seq[:5]):
        skip = i in (0, 2, 3)  # leaf 1 gets no gradient on these steps
        for p, g, j in zip(ps, grads, range(2)):
            p.grad = None if (skip and j == 1) else g.clone()
        theirs.step()
        tree, state = ours.update([g.clone() if not (skip and j == 1) else None for j, g in enumerate(grads)],
                                  state, tree)
    assert_trees_all_close(tree, [p.detach() for p in ps], rtol=RTOL, atol=ATOL)
    assert [int(s) for s in state.steps] == [5, 2]
