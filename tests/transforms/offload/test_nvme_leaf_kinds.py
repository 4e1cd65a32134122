"""zf.offload_nvme with every kind of leaf (tied, frozen, one-element, buffer, a unit under the
persistence threshold, a unit with no trainable leaf) in every unit position (the root, a
ModuleList child, a unit nested in a child), under every offload setting, W = 1, 2, 3: equal to
plain PyTorch AdamW; frozen parameters live in swap files like the trainable ones (ZeRO-Infinity
offloads every parameter), so eval steps, checkpoints and the engine read them from there, and
``state.close()`` removes them with the rest."""
import copy
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, jacfwd, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

import zfunc as zf
from assertions import RTOL, assert_close_to
from cases import micro_batches
from models import LEAF_KINDS, LeafKindsLM
from workers import workers

SWAP = tempfile.mkdtemp(prefix="zfunc-nvme-leaf-kinds-")
LR, WEIGHT_DECAY = 1e-2, 0.1


def _build(model_kw: dict, seed: int = 0) -> LeafKindsLM:
    torch.manual_seed(seed)
    return LeafKindsLM(**model_kw)


def _batch(model: LeafKindsLM, step: int, size: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, model.tok.num_embeddings, (size, model.pos.shape[0] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# How far two fp32 runs' gradients may differ by summation order (the global batch, or each rank's
# and micro-batch's part averaged), relative to the largest mean magnitude of the examples'
# gradients of the tensor: up to 27 over 60 drawn models at W = 1, 2, 3 with micro-batches of 1, 2
ROUNDING = 128 * 2.0**-24


def reference(model_kw: dict, steps: int, batch_size: int) -> dict:
    """Plain PyTorch: torch.optim.AdamW on the global batch; the loss of each step, then an eval loss;
    ``slack``: per element, how far rounding alone may move it (``adamw_slack``), each step's
    gradients off by the summation order's rounding and by the earlier steps' slack
    (``_moved_gradient``)."""
    model = _build(model_kw)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, noise = [], {n: torch.zeros_like(p) for n, p in trainable.items()}
    slack = {n: torch.zeros_like(p) for n, p in trainable.items()}
    for i in range(steps):
        x, y = _batch(model, i, batch_size)
        moved = _moved_gradient(model, trainable, x, y, slack)
        for n, scale in _example_scale(model, trainable, x, y).items():
            noise[n] = torch.maximum(noise[n], ROUNDING * scale.max() * (scale > 0) + moved[n])
        opt.zero_grad()
        value = _loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(value.item())
        for n, p in trainable.items():
            slack[n] += adamw_slack(opt, p, noise[n])
    x, y = _batch(model, steps, batch_size)
    with torch.no_grad():
        eval_loss = _loss(model(x), y).item()
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "losses": losses,
            "eval_loss": eval_loss, "slack": slack}


def _example_scale(model, trainable: dict, x, y) -> dict:
    """Per element, the mean magnitude of the examples' gradients: the scale of the terms a
    gradient sums (so of its rounding), and exactly 0 where no example has one (a token not in the
    batch), which any order sums to exactly 0."""
    scale = {n: torch.zeros_like(p) for n, p in trainable.items()}
    for b in range(len(x)):
        model.zero_grad()
        _loss(model(x[b : b + 1]), y[b : b + 1]).backward()
        for n, p in trainable.items():
            scale[n] += p.grad.abs() / len(x)
    return scale


def _moved_gradient(model, trainable: dict, x, y, slack: dict) -> dict:
    """Per element, how far the batch's gradient may move when each parameter is off by up to its
    ``slack``: ``|H| @ slack``, ``H`` the loss's Hessian (to first order). An element whose
    earlier update was rounding's (a near-zero gradient: up to a step of Adam's) moves the
    gradients downstream of it by far more than their own summation order does."""
    names = list(trainable)
    sizes = [trainable[n].numel() for n in names]

    def loss(flat):
        params = {n: v.view(trainable[n].shape) for n, v in zip(names, flat.split(sizes))}
        return _loss(functional_call(model, params, (x,)), y)

    with sdpa_kernel([SDPBackend.MATH]):  # the CPU flash attention kernel has no second derivative
        hessian = jacfwd(jacrev(loss))(torch.cat([trainable[n].detach().flatten() for n in names]))
    moved = hessian.abs() @ torch.cat([slack[n].flatten() for n in names])
    return {n: v.view(trainable[n].shape) for n, v in zip(names, moved.split(sizes))}


def adamw_slack(opt: torch.optim.AdamW, p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per element, a bound on how much the step ``opt`` just took moves ``p`` differently when
    each gradient so far is off by up to ``noise``. Adam's step is ``lr * m/(sqrt(v) + eps)``
    (bias-corrected): ``m`` and ``sqrt(v)`` are weighted means (a mean, a root mean square) of the
    gradients, so each moves by ``noise`` at most, and the step by ``lr * noise * (1 + reach) /
    (sqrt(v) + eps)``, ``reach`` bounding ``|m|/sqrt(v)`` (Cauchy-Schwarz); never more than the
    whole range of the step, ``2 * lr * reach``. Small wherever the gradient stands clear of the
    rounding; where it is rounding (an element whose exact gradient is about zero: ``sqrt(v)``
    near 0), Adam turns that rounding into a step of up to ``lr``, and the sign and size of that
    step are rounding's, in the reference too."""
    group, state = opt.param_groups[0], opt.state[p]
    (b1, b2), eps, lr, t = group["betas"], group["eps"], group["lr"], int(state["step"])
    w1 = [(1 - b1) * b1 ** (t - s) / (1 - b1**t) for s in range(1, t + 1)]
    w2 = [(1 - b2) * b2 ** (t - s) / (1 - b2**t) for s in range(1, t + 1)]
    reach = math.sqrt(sum(a * a / b for a, b in zip(w1, w2)))
    rms = (state["exp_avg_sq"] / (1 - b2**t)).sqrt()
    return lr * torch.clamp(noise * (1 + reach) / (rms + eps), max=2 * reach)


def assert_close_to_adamw(got: dict, expected: dict):
    """``assert_close_to`` (fp32 equivalence) of ``got`` with a ``reference`` run, each element
    also allowed its ``slack``. Where that reaches a step of Adam's (``LR``), the element's update
    is rounding's and the comparison says nothing: at most 1 % of the elements may be such (else
    this model or data needs changing)."""
    scale = max(v.abs().max().item() for v in expected["params"].values())
    slack = expected["slack"]
    rounding = sum(int((s >= LR).sum()) for s in slack.values())
    total = sum(s.numel() for s in slack.values())
    assert rounding <= total / 100, f"Adam's step is rounding's at {rounding} of {total} elements"
    within = {}
    for k, g in got.items():
        e = expected["params"].get(k)
        if k in slack and e is not None and g.shape == e.shape:
            g = torch.where((g - e).abs() <= slack[k] + RTOL * (e.abs() + scale), e, g)
        within[k] = g
    assert_close_to(within, expected["params"])


def _compose(base, stage: int, offload: dict | None, threshold: int, micro: int | None, under: bool,
             precision=None):
    """``zeroN([accumulate](offload_nvme([accumulate]([mixed_precision](base)))))``: accumulate
    inside offload_nvme, or outside it with ``under``; no offload_nvme with ``offload=None``."""
    # the model adds its fp32 buffer to activations: it needs its buffers in the compute dtype too
    step = zf.mixed_precision(base, precision, buffer_dtype=precision) if precision is not None else base
    step = zf.accumulate(step, micro) if micro and not under else step
    step = zf.offload_nvme(step, SWAP, buffer_size=10**6, **offload) if offload is not None else step
    step = zf.accumulate(step, micro) if micro and under else step
    if stage == 3:
        return zf.zero3(step, persistence_threshold=threshold)
    return {0: lambda s: s, 1: zf.zero1, 2: zf.zero2}[stage](step)


def leaf_run(model_kw: dict, stage: int, offload: dict | None, threshold: int, micro: int | None, under: bool,
             steps: int = 2, per_rank: int = 2, precision=None) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = _build(model_kw)
    shape = copy.deepcopy(model)

    def loss_fn(params, b):
        return _loss(zf.apply(model, params, b[0]), b[1])

    step = _compose(zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=WEIGHT_DECAY)), stage, offload,
                    threshold, micro, under, precision)
    evaluate = _compose(zf.eval_step(loss_fn), stage, offload, threshold, micro, under, precision)
    state = step.init(model)
    store = zf.swap.open_store(state)
    files, losses = sorted(os.listdir(store.dir)) if store is not None else [], []
    for i in range(steps):
        x, y = _batch(shape, i, per_rank * world)
        b = (x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
        state, metrics = step(state, micro_batches(b, micro) if micro else b)
        losses.append(metrics["loss"].item())
    x, y = _batch(shape, steps, per_rank * world)
    b = (x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
    eval_loss = evaluate(state, micro_batches(b, micro) if micro else b)["loss"].item()
    out = {"params": zf.gather_params(state), "losses": losses, "eval_loss": eval_loss, "files": files,
           "frozen_on_disk": [zf.swap.on_disk(t) for t in state.frozen.leaves],
           "homes": [p.param_home for p in state.frozen.spec.placements],
           "frozen_numel": [t.numel() for t in state.frozen.leaves],
           "frozen_dtypes": sorted({str(t.dtype) for t in state.frozen.leaves if t.numel()})}
    state.close()
    out["left"] = store is not None and os.path.exists(store.dir)
    return out


kinds = st.lists(st.sampled_from(LEAF_KINDS), unique=True).map(tuple)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(root=kinds, child=kinds, nested=kinds, all_frozen=st.lists(st.sampled_from(["child", "nested"]), unique=True),
       world=st.sampled_from([1, 2, 3]), stage=st.sampled_from([0, 1, 2, 3]), params=st.booleans(),
       optimizer=st.booleans(), micro=st.sampled_from([None, 2]), under=st.booleans(),
       threshold=st.sampled_from([0, 100]))
# blocks.0.proj.weight[5, 5]'s first gradient is -3e-10 (fp64): rounding sets Adam's first step there
@example(root=("frozen", "buffer"), child=LEAF_KINDS, nested=LEAF_KINDS, all_frozen=[], world=2, stage=0,
         params=False, optimizer=False, micro=None, under=False, threshold=0)
# blocks.0.mlp.0.weight[24, 4]'s first gradient is -7e-9 (fp64): the order of W = 3's sum moves its
# update by 9e-4, and so blocks.0.mlp.2.weight[3, 24]'s second gradient by 4e-5 (3 % of it)
@example(root=(), child=("frozen", "scalar", "buffer"), nested=(), all_frozen=[], world=3, stage=0,
         params=False, optimizer=False, micro=None, under=False, threshold=0)
@example(root=("tied", "frozen", "buffer"), child=(), nested=(), all_frozen=[], world=2, stage=3, params=True,
         optimizer=True, micro=None, under=False, threshold=0)
@example(root=LEAF_KINDS, child=LEAF_KINDS, nested=LEAF_KINDS, all_frozen=["nested"], world=3, stage=3,
         params=True, optimizer=False, micro=2, under=True, threshold=100)
def test_every_leaf_kind_in_every_position_equals_plain_pytorch(root, child, nested, all_frozen, world, stage,
                                                                  params, optimizer, micro, under, threshold):
    if params and stage in (1, 2):
        stage = 3  # zero1/2 keep the full parameters on every rank: parameters on NVMe need zero3 (or no stage)
    model_kw = {"root": root, "child": child, "nested": nested, "all_frozen": tuple(all_frozen)}
    expected = reference(model_kw, steps=2, batch_size=2 * world)
    offload = {"params": params, "optimizer": optimizer, "sub_group_size": 150}
    for r in workers(world).run(leaf_run, model_kw, stage, offload, threshold, micro, under):
        assert_close_to_adamw(r["params"], expected)
        assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
        # frozen parameters live where their unit's placement says: in swap files with params=True
        # (units under the persistence threshold stay in memory)
        homes = [(disk, home) for disk, home, n in zip(r["frozen_on_disk"], r["homes"], r["frozen_numel"]) if n]
        assert all(disk == (home == "nvme") for disk, home in homes)
        assert (params and any(home == "nvme" for _, home in homes)) == any(".frozen." in f for f in r["files"])
        assert not r["left"]  # state.close() removed every swap file


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_parameters_on_disk_under_mixed_precision_equal_the_step_without_offload(world):
    """bf16: frozen parameters are stored (and their swap files written) in bf16, as the step
    without offload stores them; bit for bit the same run."""
    args = ({}, 3, None, 0, 2, False, 2, 2, torch.bfloat16)
    plain = workers(world).run(leaf_run, *args)
    swapped = workers(world).run(leaf_run, {}, 3, {"sub_group_size": 150}, *args[3:])
    for a, b in zip(plain, swapped):
        zf.testing.assert_trees_all_equal(b["params"], a["params"])
        assert b["losses"] == a["losses"] and b["eval_loss"] == a["eval_loss"]
        assert a["frozen_dtypes"] == b["frozen_dtypes"] == ["torch.bfloat16"]
        assert all(disk for disk, n in zip(b["frozen_on_disk"], b["frozen_numel"]) if n)
        assert not any(a["frozen_on_disk"])
        assert any(".frozen.bf16." in f for f in b["files"])


def meta_init(offload: bool) -> dict:
    """zero3([offload_nvme](f)).init of the model built on the meta device, unit by unit."""
    from cases import seeded_init

    with torch.device("meta"):
        model = _build({})
    step = zf.train_step(lambda params, b: 0, zf.optim.adamw(LR))
    step = zf.zero3(zf.offload_nvme(step, SWAP) if offload else step)
    with step.init(model, init_fn=seeded_init) as state:
        return {"params": zf.gather_params(state), "on_disk": any(zf.swap.on_disk(t) for t in state.frozen.leaves)}


def test_meta_device_init_writes_frozen_shards_to_disk():
    for a, b in zip(workers(2).run(meta_init, False), workers(2).run(meta_init, True)):
        assert b["on_disk"] and not a["on_disk"]
        zf.testing.assert_trees_all_equal(b["params"], a["params"])


class FrozenTable(nn.Module):
    """A root unit that is only a frozen table, larger than the one trainable unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(2000), requires_grad=False)
        self.layers = nn.ModuleList([nn.Linear(3, 3)])

    def forward(self, x):
        return self.layers[0](x) * self.table[:3]


def _table_step(path, buffer_size: int):
    model = FrozenTable()
    step = zf.train_step(lambda p, b: zf.apply(model, p, b).square().mean(), zf.optim.adamw(1e-2))
    return zf.offload_nvme(step, path, buffer_size=buffer_size), model


def test_the_read_pool_and_buffer_size_count_frozen_files(tmp_path):
    """The pool's buffers hold the largest parameter file, frozen or not, up to buffer_size: no read
    overflows it; a frozen file larger than buffer_size (and so than a pool buffer, 4 KiB at
    least) is read into a buffer of its own each step, with the same result."""
    out = []
    for buffer_size, oversize in ((2000, False), (10, True)):
        step, model = _table_step(tmp_path, buffer_size)
        with step.init(model) as state:
            assert zf.swap.on_disk(state.frozen.leaves[0])
            for i in range(2):
                state, metrics = step(state, torch.randn(4, 3, generator=torch.Generator().manual_seed(i)))
                assert metrics["nvme"]["pool_overflow"] == 0 and metrics["nvme"]["bytes_read"] >= 2000 * 4
                assert (metrics["nvme"]["pool_oversize"] > 0) == oversize
            out.append(zf.gather_params(state))
    zf.testing.assert_trees_all_equal(out[1], out[0])


# ------------------------------------------------------------------ checkpoints


def checkpoint_run(directory: str, save: bool) -> dict:
    """zero3(offload_nvme(f)) on the model with every leaf kind (global batch 6): one step then save,
    or load into a fresh state (any world size) and step on; frozen values go through swap files."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = _build({})
    shape = copy.deepcopy(model)
    n = 6 // world

    def loss_fn(params, b):
        return _loss(zf.apply(model, params, b[0]), b[1])

    def local(i):
        x, y = _batch(shape, i, 6)
        return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]

    step = _compose(zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=WEIGHT_DECAY)), 3, {}, 0, None, False)
    with step.init(model) as state:
        if save:
            state, _ = step(state, local(0))
            zf.checkpoint.save(state, directory, "t")
            return {"params": zf.gather_params(state)}
        state, _ = zf.checkpoint.load(state, directory, "t")
        loaded = zf.gather_params(state)
        state, metrics = step(state, local(1))
        return {"loaded": loaded, "params": zf.gather_params(state), "loss": metrics["loss"].item(),
                "frozen_on_disk": any(zf.swap.on_disk(t) for t in state.frozen.leaves)}


def test_checkpoints_save_and_load_frozen_parameters_in_swap_files(tmp_path):
    """Saved at W = 2, consolidated (frozen values as built), loaded at W = 3 and W = 1: one step
    more equals two steps of plain PyTorch."""
    saved = workers(2).run(checkpoint_run, str(tmp_path), True)[0]["params"]
    model = _build({})
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen
    consolidated = zf.checkpoint.consolidate(str(tmp_path), "t")
    for n, value in frozen.items():
        assert torch.equal(consolidated[n], value)
    expected = reference({}, steps=2, batch_size=6)
    for world in (3, 1):
        for r in workers(world).run(checkpoint_run, str(tmp_path), False):
            assert r["frozen_on_disk"]
            zf.testing.assert_trees_all_equal(r["loaded"], saved)
            assert_close_to_adamw(r["params"], expected)
            assert r["loss"] == pytest.approx(expected["losses"][1], rel=1e-5)


# ------------------------------------------------------------------ the engine


def engine_run(offload_optimizer: str, gas: int) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = _build({})
    shape = copy.deepcopy(model)
    config = {"train_batch_size": 2 * world, "gradient_accumulation_steps": gas, "gradient_clipping": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "nvme", "nvme_path": SWAP},
                                    "offload_optimizer": {"device": offload_optimizer, "nvme_path": SWAP}}}
    engine = zf.initialize(model, config, loss_fn=lambda run, b: _loss(run(b[0]), b[1]))
    losses = []
    for i in range(2):
        x, y = _batch(shape, i, 2 * world)
        b = (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        losses.append(float(engine.train_batch(iter(micro_batches(b, gas)))))
    x, y = _batch(shape, 2, 2 * world)
    b = (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    eval_loss = float(engine.eval_batch(iter(micro_batches(b, gas))))
    out = {"params": zf.gather_params(engine.state), "losses": losses, "eval_loss": eval_loss,
           "frozen_on_disk": any(zf.swap.on_disk(t) for t in engine.state.frozen.leaves)}
    engine.close()
    return out


@pytest.mark.parametrize("offload_optimizer,gas", [("nvme", 1), ("none", 2)])
def test_engine_with_offload_param_nvme_trains_frozen_models(offload_optimizer, gas):
    expected = reference({}, steps=2, batch_size=4)
    for r in workers(2).run(engine_run, offload_optimizer, gas):
        assert r["frozen_on_disk"]
        assert_close_to_adamw(r["params"], expected)
        assert r["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
