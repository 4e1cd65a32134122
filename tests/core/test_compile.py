"""torch.compile under every transform: compiled blocks (in place, fullgraph, or wrapped), a
compiled model and the compiled step (zf.jit, torch.compile(step)) each equal the eager zfunc
step and plain PyTorch, compile once (no new graph after the first step), and say clearly what
they cannot do. The matrix runs on the aot_eager backend (the same graphs as inductor up to code
generation, seconds instead of minutes on CI's two cores); inductor runs a few cases."""
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import zfunc as zf
from assertions import UNIT_ROUNDOFF, assert_close_to, assert_within_roundoff
from cases import compiled, reference, reference_mixed, run_composed
from compositions import without_stage
from zfunc.testing import assert_trees_all_close
from models import DEEP_MLP as MLP
from workers import workers

KW = {"deep_mlp": MLP}
AOT = {"backend": "aot_eager"}
HOW = {
    "blocks": {"how": "blocks", **AOT},
    "fullgraph": {"how": "blocks", "fullgraph": True, **AOT},  # torchtitan's recipe: no break inside a block
    "wrapped": {"how": "wrapped", **AOT},
    "model": {"how": "model", **AOT},
    "jit": {"how": "jit", **AOT},
    "regather": {"how": "jit", "regather": True, **AOT},  # zf.jit gathering again in backward
}
# the shared compositions without their stage (drawn here), and three of this file's own: fp16 under a
# dynamic loss scale, NVMe with small buffers, the coordinator's prefetch
COMPOSITIONS = {
    "fp32": {},
    "bf16": without_stage("zero3-bf16"),
    "fp16": {"precision": {"dtype": torch.float16, "loss_scale": "dynamic"}},
    "accumulate": without_stage("zero3-accumulate"),
    "bf16+accumulate": without_stage("zero3-bf16-accumulate"),
    "offload_cpu": without_stage("zero3-offload_cpu"),
    "offload_nvme": {"offload": {"kind": "nvme", "path": "/tmp/zfunc-compile-swap", "buffer_size": 1e5}},
    "clip": without_stage("zero3-clip"),
    "prefetch": {"prefetch": True},
}


def _run(world: int, name: str, stage: int, composition: str, how: dict | None, steps: int = 3) -> list:
    kw = dict(COMPOSITIONS[composition])
    if kw.pop("prefetch", False):
        stage = 3  # the coordinator's prefetch along its trace is zero3's
    precision = kw.get("precision")
    if precision is not None and name == "frozen_bn":  # adds a buffer to activations: buffers in the dtype too
        precision = precision | {"buffer_dtype": precision["dtype"]}
    return workers(world).run(run_composed, name, KW.get(name, {}), stage, steps, 4, 0, precision,
                              kw.get("micro"), kw.get("clip"), False, None, False, None, kw.get("offload"), how)


def _same(a: dict, b: dict, composition: str) -> None:
    """The compiled run equals the eager one: fp32 to 1e-5 (aot_eager runs the same kernels, in
    the order autograd would; a reduction may still be fused differently), lower precision to
    a few units of its roundoff of the master weights' step."""
    rel = 1e-5 if "bf16" not in composition and "fp16" not in composition else 4 * UNIT_ROUNDOFF[
        torch.bfloat16 if "bf16" in composition else torch.float16]
    _close(a["params"], b["params"], rel)
    assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]], rel=rel, abs=1e-6)


def _close(got: dict, want: dict, rel: float) -> None:
    scale = max(v.abs().max().item() for v in want.values())
    assert list(got) == list(want)
    assert_trees_all_close(got, want, rtol=rel, atol=rel * scale)


def _compiles_once(r: dict) -> None:
    assert r["graphs"][0] > 0, "nothing was compiled"
    assert r["graphs"][-1] == r["graphs"][0], f"new graphs after the first step: {r['graphs']}"


@pytest.mark.parametrize("how", ["blocks", pytest.param("fullgraph", marks=pytest.mark.slow), pytest.param("wrapped", marks=pytest.mark.slow), "model", "jit", pytest.param("regather", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["gpt", pytest.param("checkpointed", marks=pytest.mark.slow), pytest.param("external", marks=pytest.mark.slow)])
def test_each_way_of_compiling_equals_eager_and_pytorch(name, how):
    """A tied GPT (head read in the root), activation checkpointing inside and around blocks,
    weights read outside their module: zero3 at W = 2, each way of compiling."""
    if how == "wrapped" and name == "external":
        return  # its forward indexes into a block, which torch.compile's wrapper does not allow
    expected = reference(name, {}, steps=3, batch_size=8)
    eager = _run(2, name, 3, "fp32", None)
    for r, e in zip(_run(2, name, 3, "fp32", HOW[how]), eager):
        _same(r, e, "fp32")
        assert_close_to(r["params"], expected["params"])
        _compiles_once(r)


@pytest.mark.slow
@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck))
@given(how=st.sampled_from(["blocks", "wrapped", "model", "jit", "regather"]), stage=st.sampled_from([0, 1, 2, 3]),
       composition=st.sampled_from(list(COMPOSITIONS)), world=st.sampled_from([1, 2, 3]),
       name=st.sampled_from(["deep_mlp", "gpt", "frozen_bn"]))
def test_any_composition_compiled_equals_eager(how, stage, composition, world, name):
    """Compiled blocks, models and steps under any stage, precision, accumulation, offload,
    clipping and prefetch, W = 1, 2, 3: the eager step's numbers, and no new graph after step 1."""
    if how in ("jit", "regather") and composition == "offload_nvme":
        return  # zf.jit refuses it (test_jit_refuses_what_leaves_ram)
    if composition == "offload_nvme" and stage in (1, 2):
        composition = "offload_cpu"  # parameters on NVMe need zero3 (zero1/2 keep them whole)
    eager = _run(world, name, stage, composition, None)
    for r, e in zip(_run(world, name, stage, composition, HOW[how]), eager):
        _same(r, e, composition)
        _compiles_once(r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_blocks_in_low_precision_match_pytorch(dtype):
    """Against plain PyTorch doing the same mixed precision, within the suite's bound."""
    precision = {"dtype": dtype} | ({"loss_scale": 1024.0} if dtype == torch.float16 else {})
    init = reference("deep_mlp", MLP, steps=0)["params"]
    expected = reference_mixed("deep_mlp", MLP, dtype, steps=3, batch_size=8,
                               loss_scale=1024.0 if dtype == torch.float16 else 1.0)
    for r in workers(2).run(run_composed, "deep_mlp", MLP, 3, 3, 4, 0, precision, None, None, False, None,
                            False, None, None, HOW["fullgraph"]):
        assert_within_roundoff(r["params"], expected["params"], init, UNIT_ROUNDOFF[dtype], False)


@pytest.mark.parametrize("how", ["blocks", pytest.param("jit", marks=pytest.mark.slow)])
def test_inductor(how):
    """The default backend, generating C++ for the CPU: zero3 at W = 2 equals eager within
    inductor's reordering of float reductions (a few ulps a step, amplified by Adam's division
    by sqrt(v) on near-zero second moments in the first steps)."""
    eager = _run(2, "deep_mlp", 3, "fp32", None)
    for r, e in zip(_run(2, "deep_mlp", 3, "fp32", {"how": how}), eager):
        _close(r["params"], e["params"], 1e-4)
        _compiles_once(r)


def test_a_compiled_model_says_once_where_it_breaks():
    torch.manual_seed(0)
    model = compiled(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])), HOW["model"])
    inner = model._orig_mod
    inner.forward = lambda x: inner[1][1](inner[1][0](inner[0](x)))

    def loss_fn(params, x):
        return zf.apply(model, params, x).sum()

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.sgd(0.1)))
    state = step.init(model)
    with pytest.warns(zf.GraphBreakWarning, match=r"2 unit boundaries \(1\.0, 1\.1\)"):
        state, _ = step(state, torch.ones(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", zf.GraphBreakWarning)
        step(state, torch.ones(2, 4))
    assert set(zf.gather_params(state)) == {"0.weight", "0.bias", "1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"}


def test_a_fullgraph_model_raises_naming_what_to_compile():
    model = compiled(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)])), {"how": "model", "fullgraph": True, **AOT})
    inner = model._orig_mod
    inner.forward = lambda x: inner[1][0](inner[0](x))
    step = zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), zf.optim.sgd(0.1)))
    state = step.init(model)
    with pytest.raises(zf.CompileError, match=r"compile the blocks instead: zf.compile_units\(model, fullgraph=True\)"), \
            pytest.warns(zf.GraphBreakWarning, match="1 unit boundary"):
        step(state, torch.ones(2, 4))


def test_torch_compile_of_a_step_runs_the_compiled_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    twin = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    twin.load_state_dict(model.state_dict())
    results = []
    for m, wrap in ((model, lambda s: torch.compile(s, backend="aot_eager")), (twin, lambda s: s)):
        step = zf.zero3(zf.train_step(lambda p, b, m=m: ((zf.apply(m, p, b[0]) - b[1]) ** 2).mean(),
                                      zf.optim.adamw(1e-2)))
        state = step.init(m)
        run = wrap(step)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for i in range(3):
                g = torch.Generator().manual_seed(i)
                state, metrics = run(state, (torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)))
        results.append((zf.gather_params(state), [str(w.message) for w in said if issubclass(w.category, zf.CompileWarning)]))
    (jitted, said), (eager, _) = results
    _close(jitted, eager, 1e-5)
    assert len(said) == 1 and "runs zf.jit(step)" in said[0]


def test_jit_refuses_what_leaves_ram(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    step = zf.jit(zf.zero3(zf.offload_nvme(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), zf.optim.sgd(0.1)),
                                           path=str(tmp_path))), **AOT)
    with step.init(model) as state:
        with pytest.raises(zf.CompileError, match="Compile the blocks instead"):
            step(state, torch.ones(2, 4))
    with pytest.raises(ValueError, match="already applied"):
        zf.jit(step)


class _Breaks(nn.Module):
    """A block dynamo cannot trace whole: a data-dependent Python branch on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if h.sum().item() > 0 else h


def test_a_block_that_cannot_compile_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), _Breaks()]))
    model.forward = lambda x: model[1][1](model[1][0](model[0](x)))
    zf.compile_units(model, fullgraph=True, **AOT)
    step = zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(), zf.optim.sgd(0.1)))
    state = step.init(model)
    with pytest.raises(zf.CompileError, match=r"could not compile unit '1\.1' under zfunc: .*leave it eager"):
        step(state, torch.ones(2, 4))


def test_jit_leaves_a_unit_the_loss_does_not_use_alone():
    """As the eager step (and torch.optim with set_to_none): no gradient, no update, not even weight decay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    model.forward = lambda x: model[1][0](model[0](x))  # unit 1.1 never runs
    step = zf.jit(zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, x).sum(),
                                         zf.optim.adamw(0.1, weight_decay=0.1))), **AOT)
    state = step.init(model)
    before = zf.gather_params(state)
    state, _ = step(state, torch.ones(2, 4))
    after = zf.gather_params(state)
    assert torch.equal(before["1.1.weight"], after["1.1.weight"])
    assert not torch.equal(before["1.0.weight"], after["1.0.weight"])


def _skipping_run(how: str | None, meta: bool) -> dict:
    """Three steps of a model whose forward skips a block by control flow (another one each step),
    built on the meta device or not, blocks compiled or not."""
    from cases import seeded_init
    from models import build

    with torch.device("meta" if meta else "cpu"):
        model = build("skipping")
    if how is not None:
        model = compiled(model, HOW[how])
    step = zf.zero3(zf.train_step(lambda p, b: ((zf.apply(model, p, b[0]) - b[1]) ** 2).mean(),
                                  zf.optim.adamw(1e-2, weight_decay=0.1)))
    if how == "jit":
        step = zf.jit(step, **AOT)  # one program per path (dynamo guards on model.skip)
    state = step.init(model, init_fn=seeded_init if meta else None)
    for i, skip in enumerate([None, 1, 1, None]):
        model.skip = skip
        g = torch.Generator().manual_seed(i)
        state, _ = step(state, (torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)))
    return zf.gather_params(state)


@pytest.mark.filterwarnings("ignore::zfunc.GraphBreakWarning")
@pytest.mark.parametrize("meta", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.parametrize("how", ["blocks", "model", "jit"])
def test_blocks_skipped_by_control_flow_and_meta_init_compiled(how, meta):
    """A skipped block gets no update, compiled or not; a meta-device model compiles as a built one."""
    _close(_skipping_run(how, meta), _skipping_run(None, meta), 1e-5)


def saved_bytes_of_jit(regather: bool) -> dict:
    """Bytes autograd keeps for backward in one zf.jit(zero3) step of 4 wide layers, besides the
    state's own shards, and the result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(256, 256, bias=False) for _ in range(4)]))
    model.forward = lambda x: torch.tanh(model[0][3](torch.tanh(model[0][2](torch.tanh(model[0][1](torch.tanh(model[0][0](x))))))))
    step = zf.jit(zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, x).square().mean(), zf.optim.adamw(1e-2))),
                  regather=regather, **AOT)
    state = step.init(model)
    saved = []
    shards = {t.untyped_storage().data_ptr() for t in state.params.leaves}  # the state's own memory

    def pack(t):
        if t.untyped_storage().data_ptr() not in shards:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for i in range(2):
            saved.clear()
            state, _ = step(state, torch.randn(8, 256, generator=torch.Generator().manual_seed(i)))
    return {"saved": sum(saved), "params": zf.gather_params(state)}


@pytest.mark.slow
def test_jit_regather_keeps_shards_not_gathered_units():
    """zf.jit(..., regather=True): the all-gathers are done again in backward (SimpleFSDP's
    policy), so backward keeps only the state's shards and the activations, not the gathered
    weights (256 KB each; the first layer's is not needed: the input takes no gradient); same numbers."""
    kept, regathered = workers(2).run(saved_bytes_of_jit, False), workers(2).run(saved_bytes_of_jit, True)
    gathered = 3 * 256 * 256 * 4
    activations = 8 * 8 * 256 * 4  # at most two 8 x 256 fp32 tensors per layer
    for k, r in zip(kept, regathered):
        _close(r["params"], k["params"], 1e-6)
        assert k["saved"] >= gathered, k["saved"]
        assert r["saved"] <= activations < k["saved"] - gathered + activations, (r["saved"], k["saved"])
