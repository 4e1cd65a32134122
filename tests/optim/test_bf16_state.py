"""Adam's moments in bf16 (``zf.optim.adamw(..., state_dtype=torch.bfloat16)``) equal their plain
PyTorch definition (tests/harness/bf16_state_reference.py: torch.optim.AdamW with its moments rounded
to bf16 after each step) under every stage, offload_cpu and offload_nvme, accumulation, clipping and
mixed precision, at W = 1 and 2; the moments stay bf16 wherever they live (RAM, swap files,
checkpoints), memory_report counts the smaller state, and a checkpoint's moments of the other dtype
load converted (fp32 rounded to nearest even, bf16 widened exactly)."""
import os
import tempfile

import pytest
import torch

import zfunc as zf
from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from bf16_state_reference import AdamWBf16State, assert_moments_close, reference
from cases import LR, _setup, compose, micro_batches
from models import DEEP_MLP as MLP, batch, local
from workers import workers
from zfunc.ops import torch_adam
from zfunc.optim.base import state_bytes_per_element
from zfunc.state import unit_values

BF16 = torch.bfloat16
SWAP = tempfile.mkdtemp(prefix="zfunc-bf16-state-")
OFFLOADS = {"none": None, "cpu": {"kind": "cpu"}, "nvme": {"kind": "nvme", "path": SWAP}}


def _offload(kind: str, stage: int):
    """``OFFLOADS[kind]`` for ``stage``: below zero3 the parameters stay in memory (``params=False``)."""
    out = OFFLOADS[kind]
    return {**out, "params": False} if kind == "nvme" and stage < 3 else out


# ------------------------------------------------------------ the optimizer alone (fast)

def test_state_dtype_must_be_fp32_or_bf16():
    for make in (zf.optim.adamw, zf.optim.adam):
        with pytest.raises(ValueError, match="state_dtype must be torch.float32 .* or torch.bfloat16.*float16"):
            make(1e-3, state_dtype=torch.float16)
    assert state_bytes_per_element(zf.optim.adamw(1e-3)) == 8
    assert state_bytes_per_element(zf.optim.adamw(1e-3, state_dtype=BF16)) == 4


def test_the_optimizer_equals_its_reference():
    """adamw's own init and update on a dict of tensors (the CPU kernel where built), five steps."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (257, 33), "b": (33,)}
    start = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(5)]
    ref = {k: v.clone().requires_grad_() for k, v in start.items()}
    opt_ref = AdamWBf16State(ref.values(), lr=LR, weight_decay=0.01)
    opt = zf.optim.adamw(LR, weight_decay=0.01, state_dtype=BF16)
    params = {k: v.clone() for k, v in start.items()}
    state = opt.init(params)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt_ref.step()
        params, state = opt.update({k: v.clone() for k, v in g.items()}, state, params)
    assert {t.dtype for t in (*state.mu.values(), *state.nu.values())} == {BF16}
    assert_close_to(params, {k: v.detach() for k, v in ref.items()})
    for key, ours in (("exp_avg", state.mu), ("exp_avg_sq", state.nu)):
        assert_moments_close(ours, {k: opt_ref.state[p][key].to(BF16) for k, p in ref.items()}, key)


def test_the_torch_fallback_is_the_reference():
    """Without the kernel (other devices, non-contiguous tensors) torch's fused AdamW runs on fp32
    working copies of the moments that are stored rounded: the reference's own rounding, so the
    moments are its bit for bit."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(4099, generator=gen)
    grads = [torch.randn(4099, generator=gen) for _ in range(4)]
    ref = p0.clone().requires_grad_()
    opt_ref = AdamWBf16State([ref], lr=LR, weight_decay=0.01)
    p, m, v = p0.clone(), torch.zeros(4099, dtype=BF16), torch.zeros(4099, dtype=BF16)
    for t, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        opt_ref.step()
        torch_adam.torch_adam_([p], [g], [m], [v], step=t, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, decoupled=True)
    assert torch.equal(m, opt_ref.state[ref]["exp_avg"].to(BF16))
    assert torch.equal(v, opt_ref.state[ref]["exp_avg_sq"].to(BF16))
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ composed steps (workers)

def _moments(state) -> dict:
    """Each parameter's full moments in their stored dtype, keyed like ``gather_params`` (every rank)."""
    node = _adam_state(state.opt_state)
    names = list(zf.gather_params(state))
    out = {}
    for key, tree in (("exp_avg", node.mu), ("exp_avg_sq", node.nu)):
        named = {}
        for i in range(len(tree.leaves)):
            named.update(tree.spec.segment(i).unflatten(unit_values(tree, i)))
        out[key] = {n: named[n].detach().cpu().clone() for n in names}
    return out


def _adam_state(node):
    """The AdamState inside the wrappers (``inner``) and chains (tuples) of an optimizer state."""
    if isinstance(node, zf.optim.AdamState):
        return node
    for child in ([node.inner] if hasattr(node, "inner") else node if isinstance(node, tuple) else []):
        found = _adam_state(child)
        if found is not None:
            return found
    return None


def run_bf16(name: str, kw: dict, stage: int, steps: int, per_rank: int, state_dtype, precision=None, micro=None,
             clip=None, offload=None) -> dict:
    """``steps`` steps of the composed step with ``adamw(state_dtype=)``: parameters, losses, moments,
    their dtypes where they are kept, and memory_report."""
    rank, world, model, shape_model, loss_fn = _setup(name, kw, 0)
    opt = zf.optim.adamw(LR, weight_decay=0.01, state_dtype=state_dtype)
    step = compose(stage, loss_fn, clip=clip, precision=precision, micro=micro, opt=opt, offload=offload)
    state = step.init(model)
    losses = []
    for i in range(steps):
        b = local(batch(name, shape_model, i, per_rank * world, 0), rank, world)
        state, metrics = step(state, micro_batches(b, micro) if micro else b)
        losses.append(metrics["loss"].item())
    with state:
        moments = _moments(state)
        return {"params": zf.gather_params(state), "losses": losses, "moments": moments,
                "held": sorted({str(zf.swap.load(t).dtype) for t in zf.pytree.tree_leaves(state.opt_state)
                                if isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point()}),
                "memory": zf.memory_report(state), "numel": sum(t.numel() for t in state.params.leaves),
                "composition": step.composition}


def _assert_equals_reference(r: dict, ref: dict) -> None:
    assert_close_to(r["params"], ref["params"])
    assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for key in ("exp_avg", "exp_avg_sq"):
        assert_moments_close(r["moments"][key], ref["moments"][key], key)


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_two_steps_of_zero3_equal_the_reference(world):
    """The fast sibling of the cross-product below: zero3 on the small MLP, two steps."""
    ref = reference("deep_mlp", MLP, steps=2, batch_size=2 * world)
    for r in workers(world).run(run_bf16, "deep_mlp", MLP, 3, 2, 2, BF16):
        _assert_equals_reference(r, ref)
        assert r["held"] == ["torch.bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize("offload", list(OFFLOADS))
@pytest.mark.parametrize("world", [1, 2])
def test_every_stage_and_offload_equals_the_reference(world, offload):
    """fp32 parameters, bf16 moments: zero0-3, alone and under offload_cpu / offload_nvme, against the
    plain PyTorch definition; the moments are bf16 where they are kept (swap files included), and
    memory_report's optimizer bytes (zero0 and zero3 on the GPT) are the fp32-state run's less 4 bytes an
    element."""
    for name, kw in (("gpt", {}), ("deep_mlp", MLP)):
        ref = reference(name, kw, steps=3, batch_size=2 * world)
        for stage in (0, 1, 2, 3):
            ours = workers(world).run(run_bf16, name, kw, stage, 3, 2, BF16, None, None, None, _offload(offload, stage))
            for r in ours:
                assert offload == "none" or r["composition"].count("offload_" + offload) == 1
                _assert_equals_reference(r, ref)
                assert r["held"] == ["torch.bfloat16"]
            if name != "gpt" or stage not in (0, 3):
                continue
            fp32 = workers(world).run(run_bf16, name, kw, stage, 1, 2, torch.float32, None, None, None,
                                      _offload(offload, stage))
            for r, f in zip(ours, fp32):
                assert f["held"] == ["torch.float32"]
                assert r["memory"]["optimizer_bytes"] == f["memory"]["optimizer_bytes"] - 4 * r["numel"]
                if offload == "nvme":
                    assert r["memory"]["by_home"]["disk"] == f["memory"]["by_home"]["disk"] - 4 * r["numel"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_accumulation_and_clipping_equal_the_reference(world):
    """Two micro-batches and clipping at the global norm, every stage, with and without offload_cpu."""
    ref = reference("deep_mlp", MLP, steps=3, batch_size=4 * world, clip=0.05)
    for stage in (0, 1, 2, 3):
        for offload in ("none", "cpu"):
            for r in workers(world).run(run_bf16, "deep_mlp", MLP, stage, 3, 4, BF16, None, 2, 0.05,
                                        _offload(offload, stage)):
                _assert_equals_reference(r, ref)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision_keeps_fp32_masters_and_bf16_moments(world):
    """bf16 compute, fp32 master weights, bf16 moments: within mixed precision's own bound of the plain
    PyTorch definition (tests/transforms/test_precision.py), and offload_cpu / offload_nvme equal
    the step without offload bit for bit."""
    init = reference("deep_mlp", MLP, steps=0)["params"]
    ref = reference("deep_mlp", MLP, steps=3, batch_size=4 * world, dtype=BF16)
    for stage in (0, 1, 2, 3):
        runs = {o: workers(world).run(run_bf16, "deep_mlp", MLP, stage, 3, 4, BF16, {"dtype": BF16}, None, None,
                                      _offload(o, stage)) for o in OFFLOADS}
        for rank, r in enumerate(runs["none"]):
            assert_within_roundoff(r["params"], ref["params"], init, UNIT_ROUNDOFF[BF16], False)
            assert r["held"] == ["torch.bfloat16", "torch.float32"]  # the moments, the masters
            for o in ("cpu", "nvme"):
                other = runs[o][rank]
                assert all(torch.equal(other["params"][k], v) for k, v in r["params"].items()), (o, stage)
                assert other["losses"] == r["losses"]
                for key in ("exp_avg", "exp_avg_sq"):
                    assert all(torch.equal(other["moments"][key][k], v) for k, v in r["moments"][key].items())


# ------------------------------------------------------------ checkpoints

def save_bf16(directory: str, stage: int, steps: int, state_dtype, offload=None) -> dict:
    """Train ``steps`` steps of the GPT with ``adamw(state_dtype=)`` and save; its moments."""
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    step = compose(stage, loss_fn, opt=zf.optim.adamw(LR, weight_decay=0.01, state_dtype=state_dtype),
                   offload=offload)
    state = step.init(model)
    for i in range(steps):
        state, _ = step(state, local(batch("gpt", shape_model, i, 6, 0), rank, world))
    zf.checkpoint.save(state, directory, f"step{steps}")
    with state:
        return {"moments": _moments(state)}


def load_bf16(directory: str, stage: int, start: int, steps: int, state_dtype, offload=None) -> dict:
    """Load into a fresh ``adamw(state_dtype=)`` step, read its moments, train ``steps`` more steps."""
    rank, world, model, shape_model, loss_fn = _setup("gpt", {}, 0)
    step = compose(stage, loss_fn, opt=zf.optim.adamw(LR, weight_decay=0.01, state_dtype=state_dtype),
                   offload=offload)
    state, _ = zf.checkpoint.load(step.init(model), directory)
    loaded = _moments(state)
    losses = []
    for i in range(start, start + steps):
        state, metrics = step(state, local(batch("gpt", shape_model, i, 6, 0), rank, world))
        losses.append(metrics["loss"].item())
    with state:
        return {"loaded": loaded, "params": zf.gather_params(state), "moments": _moments(state), "losses": losses}


@pytest.mark.slow
def test_a_checkpoint_keeps_bf16_moments_and_resumes_exactly(tmp_path):
    """Saved at W = 2 (zero2) after 2 steps, loaded at W = 1 (zero3 under offload_nvme) and W = 2 (zero3
    under offload_cpu): the moments come back bit for bit as bf16, and a third step equals three
    uninterrupted steps of the reference."""
    directory = str(tmp_path / "ckpt")
    saved = workers(2).run(save_bf16, directory, 2, 2, BF16)[0]
    ref = reference("gpt", {}, steps=3, batch_size=6)
    ref_losses = ref["losses"][2:]
    nvme = {"kind": "nvme", "path": os.path.join(SWAP, "ckpt")}
    for world, offload in ((1, nvme), (2, OFFLOADS["cpu"])):
        for r in workers(world).run(load_bf16, directory, 3, 2, 1, BF16, offload):
            for key in ("exp_avg", "exp_avg_sq"):
                assert all(r["loaded"][key][k].dtype == BF16 and torch.equal(r["loaded"][key][k], v)
                           for k, v in saved["moments"][key].items())
            _assert_equals_reference(r, {**ref, "losses": ref_losses})


@pytest.mark.slow
def test_a_checkpoint_of_the_other_state_dtype_loads_converted(tmp_path):
    """fp32 moments into a bf16-state step: rounded to nearest even (torch's cast), exactly; bf16 moments
    into an fp32-state step: widened, exactly. Training goes on from the converted moments."""
    for saved_dtype, loaded_dtype in ((torch.float32, BF16), (BF16, torch.float32)):
        directory = str(tmp_path / f"from-{str(saved_dtype)[6:]}")
        saved = workers(2).run(save_bf16, directory, 1, 2, saved_dtype)[0]
        for r in workers(1).run(load_bf16, directory, 3, 2, 1, loaded_dtype):
            for key in ("exp_avg", "exp_avg_sq"):
                for k, v in saved["moments"][key].items():
                    got = r["loaded"][key][k]
                    assert got.dtype == loaded_dtype and torch.equal(got, v.to(loaded_dtype)), (key, k)
            assert all(torch.isfinite(p).all() for p in r["params"].values()) and len(r["losses"]) == 1
