"""Pretrained weights in: ``step.init(model, weights=PATH)`` and ``zf.initialize(..., weights=PATH)``.

Tiny Hugging Face models built from a config (no download) are written by
``save_pretrained(dir, max_shard_size=...)`` into several shards, then read into models
built on the meta device under every composition: the loaded state equals the saved model
bit for bit, one step equals plain PyTorch on it, and each rank reads only its shards' bytes.
Damaged, missing and extra tensors are named."""
import contextlib
import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import zfunc as zf
from zfunc.testing import memory
from zfunc.weights.pretrained import WeightsMismatch
from assertions import assert_close_to
from hf import LR, build, rewrite_checkpoint, tokens
from workers import fresh_workers, workers

import transformers  # noqa: E402  the [test] extra installs it
import safetensors.torch as safetensors  # noqa: E402
SHARD = "20KB"  # each tiny model in 2-4 files

_saved: dict = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(kind)``: the folder ``save_pretrained`` wrote for ``build(kind)``, in several shards."""

    def get(kind: str) -> str:
        if kind not in _saved:
            path = str(tmp_path_factory.mktemp(kind))
            build(kind).save_pretrained(path, max_shard_size=SHARD)
            _saved[kind] = path
        return _saved[kind]

    return get


def reference(kind: str, size: int, micro: int = 1) -> dict:
    """Plain PyTorch: the saved model, one AdamW step (defaults) on the global batch."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = tokens(size)
    opt.zero_grad(set_to_none=True)
    loss = sum(model(input_ids=m, labels=m).loss for m in x.chunk(micro)) / micro
    loss.backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def compose(how: dict, loss_fn):
    step = zf.train_step(loss_fn, zf.optim.adamw(LR))
    if how.get("accumulate"):
        step = zf.accumulate(step, how["accumulate"])
    if how.get("precision"):
        step = zf.mixed_precision(step, torch.bfloat16)
    if how.get("offload") == "cpu":
        step = zf.offload_cpu(step, params=how.get("params", False), copy_grads_on_host=True)
    if how.get("offload") == "nvme":
        step = zf.offload_nvme(step, how["swap"], sub_group_size=1)
    step = {0: lambda s: s, 1: zf.zero1, 2: zf.zero2, 3: zf.zero3}[how.get("stage", 3)](step)
    if how.get("compile") == "jit":
        step = zf.jit(step, backend="eager")
    return step


def run(kind: str, path: str, how: dict, per_rank: int = 2) -> dict:
    """``build(kind)`` on the meta device (or the CPU with another seed, ``how["built"]``), composed as
    ``how``, its state read from ``path``; the state, one step later, and the bytes this rank read."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    torch._dynamo.reset()
    model = build(kind, "cpu", seed=1) if how.get("built") else build(kind, "meta")
    if how.get("compile") == "units":
        zf.compile_units(model, backend="eager")
    if how.get("compile") == "model":
        model = torch.compile(model, backend="eager")

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = compose(how, loss_fn)
    with counting_reads() as read:
        state = step.init(model, weights=path)
    out = {"loaded": zf.gather_params(state), "buffers": dict(state.buffers), "read": read[0]}
    x = tokens(per_rank * world)[rank * per_rank : (rank + 1) * per_rank]
    batch = list(x.chunk(how["accumulate"])) if how.get("accumulate") else x
    state, _ = step(state, batch)
    out["stepped"] = zf.gather_params(state)
    state.close()
    return out


@contextlib.contextmanager
def counting_reads():
    """Bytes the safetensors reader reads inside the block, in ``[0]``."""
    from zfunc.weights.safetensors_reader import Reader

    count = [0]
    pread = Reader._pread

    def counted(self, info, dest, offset):
        count[0] += dest.numel()
        pread(self, info, dest, offset)

    Reader._pread = counted
    try:
        yield count
    finally:
        Reader._pread = pread


def saved_values(kind: str) -> dict:
    model = build(kind)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def data_bytes(path: str) -> int:
    from zfunc.weights.safetensors_reader import tensors_of

    return sum(i.nbytes for i in tensors_of(path).values())


CASES = [  # (model, W, composition): every composition once, every model once, zero3 and nvme at W = 2 and 3
    ("llama", 1, {"stage": 0}),
    ("gpt2", 2, {"stage": 1}),
    ("qwen2", 2, {"stage": 2, "accumulate": 2}),
    ("llama", 3, {"stage": 3}),
    ("mixtral", 2, {"stage": 3}),
    ("t5", 2, {"stage": 3}),
    ("llama", 2, {"offload": "nvme"}),
    ("gpt2", 3, {"offload": "nvme"}),
    ("qwen2", 1, {"offload": "cpu"}),
    ("t5", 3, {"offload": "cpu", "params": True}),
    ("gpt2", 1, {"compile": "units"}),  # compiled forms at W = 1: compiling is the cost
    ("qwen2", 1, {"compile": "model"}),
    ("llama", 1, {"compile": "jit"}),
    ("gpt2", 1, {"built": True}),
]


@pytest.mark.parametrize("kind,world,how", [pytest.param(*c, marks=pytest.mark.slow) if c[1] == 3 or "compile" in c[2] else c for c in CASES],
                         ids=[f"{k}-W{w}-{'-'.join(map(str, h.values()))}" for k, w, h in CASES])
def test_loaded_state_is_the_checkpoint_and_steps_like_pytorch(kind, world, how, saved, tmp_path):
    """The state read from the files equals the saved model bit for bit (parameters and buffers,
    tied ones once), one step equals plain PyTorch on it; under zero3 every byte of the files is
    read by exactly one rank."""
    path = saved(kind)
    how = dict(how, swap=str(tmp_path)) if how.get("offload") == "nvme" else how
    want, expected = saved_values(kind), reference(kind, 2 * world, how.get("accumulate", 1))
    buffers = dict(build(kind).named_buffers())
    results = workers(world).run(run, kind, path, how)
    for r in results:
        assert list(r["loaded"]) == list(want)
        for k, v in want.items():
            assert torch.equal(r["loaded"][k], v), k
        for k, v in r["buffers"].items():
            assert torch.equal(v, buffers[k]), k
        assert_close_to(r["stepped"], expected)
    if how.get("stage", 3) == 3 and not how.get("built"):
        total = data_bytes(path)
        assert sum(r["read"] for r in results) == total
        assert all(r["read"] <= total / world + 64 for r in results)


def run_bf16(kind: str, path: str) -> dict:
    """zero3(mixed_precision(bf16)) read from the files, and from the saved model built on the CPU."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    out = {}
    for source in ("weights", "model"):
        model = build(kind, "meta" if source == "weights" else "cpu")
        step = compose({"precision": True}, lambda p, x, m=model: zf.apply(m, p, input_ids=x, labels=x).loss)
        state = step.init(model, weights=path) if source == "weights" else step.init(model)
        state, _ = step(state, tokens(2 * world)[rank * 2 : (rank + 1) * 2])
        out[source] = {"params": [t.clone() for t in state.params.leaves], "master": zf.gather_params(state)}
    return out


def test_mixed_precision_state_from_weights_is_the_one_from_the_model(saved):
    """zero3(mixed_precision(bf16)) at W = 2: the bf16 parameters and fp32 master weights after a
    step are bit for bit those of the same step initialized from the built model."""
    for r in workers(2).run(run_bf16, "llama", saved("llama")):
        assert all(torch.equal(a, b) for a, b in zip(r["weights"]["params"], r["model"]["params"]))
        assert all(torch.equal(r["weights"]["master"][k], v) for k, v in r["model"]["master"].items())


def mixed_dtypes(device: str = "cpu") -> nn.Module:
    """T5 in bf16 with its feed-forward output projections in fp32 (Hugging Face's
    ``_keep_in_fp32_modules``), so a unit holds two dtypes."""
    model = build("t5", device).to(torch.bfloat16)
    for name, m in model.named_modules():
        if name.endswith("DenseReluDense.wo"):
            m.float()
    return model


def run_mixed(path: str) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    out = {}
    for source in ("weights", "model"):
        model = mixed_dtypes("meta" if source == "weights" else "cpu")
        step = compose({}, lambda p, x, m=model: zf.apply(m, p, input_ids=x, labels=x).loss)
        state = step.init(model, weights=path) if source == "weights" else step.init(model)
        units = {u.name: u.trainable.dtype for u in state.params.spec.model.units}
        loaded = zf.gather_params(state)
        state, _ = step(state, tokens(2 * world)[rank * 2 : (rank + 1) * 2])
        out[source] = {"units": units, "loaded": loaded, "stepped": zf.gather_params(state)}
    return out


def test_a_model_that_keeps_two_dtypes_loads(tmp_path):
    """bf16 T5 with fp32 ``wo`` projections: each ``wo`` is a unit of its own, the state is the
    checkpoint's values, and a step at W = 2 equals the one from the built model, bit for bit."""
    model = mixed_dtypes()
    model.save_pretrained(tmp_path, max_shard_size=SHARD)
    want = {k: v.float() for k, v in model.named_parameters()}
    for r in workers(2).run(run_mixed, str(tmp_path)):
        units = r["weights"]["units"]
        assert units["encoder.block.0.layer.1.DenseReluDense.wo"] == torch.float32
        assert units["encoder.block.0.layer.1"] == torch.bfloat16
        assert all(torch.equal(r["weights"]["loaded"][k], v) for k, v in want.items())
        for k, v in r["model"]["stepped"].items():
            assert torch.equal(r["weights"]["stepped"][k], v), k


# ------------------------------------------------------------------ zf.initialize


def engine_run(path: str) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build("llama", "meta")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3}}
    engine = zf.initialize(model, config, weights=path)
    x = tokens(2 * world)[rank * 2 : (rank + 1) * 2]
    engine.train_batch(iter([{"input_ids": x, "labels": x}]))
    out = engine.params()
    engine.close()
    return out


def test_initialize_reads_weights_into_a_meta_built_model(saved):
    """zf.initialize(meta-built Llama, config, weights=PATH) at W = 2: one train_batch equals plain
    PyTorch from the saved weights (RMSNorm has no reset_parameters; nothing needs one)."""
    expected = reference("llama", 4)
    for got in workers(2).run(engine_run, saved("llama")):
        assert_close_to(got, expected)


# ------------------------------------------------------------------ errors


def _init(kind: str, path, **kw):
    model = build(kind, "meta")
    return zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.adamw(LR))).init(model, weights=path, **kw)


def test_missing_unexpected_and_misshaped_tensors_are_named(saved, tmp_path):
    src = saved("llama")
    missing = rewrite_checkpoint(src, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up" not in k})
    with pytest.raises(ValueError, match=r"files lack: 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        _init("llama", missing)
    extra = rewrite_checkpoint(src, tmp_path / "extra", lambda t: {**t, "model.layers.0.extra": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"model has not: 'model\.layers\.0\.extra'"):
        _init("llama", extra)
    shaped = rewrite_checkpoint(src, tmp_path / "shape", lambda t: {**t, "model.norm.weight": torch.ones(17)})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(17,\) .* but shape \(16,\)"):
        _init("llama", shaped)


def test_strict_false_initializes_what_the_files_lack(saved, tmp_path):
    """As load_state_dict(strict=False): the missing tensor is initialized as without weights (its
    module's own init), the rest read; a tensor the model has not is skipped."""
    src = saved("llama")
    path = rewrite_checkpoint(src, tmp_path / "part", lambda t: {**{k: v for k, v in t.items() if k != "model.norm.weight"},
                                                       "unused": torch.zeros(2)})
    with pytest.warns(WeightsMismatch, match=r"20 of the model's 21 tensors read; 1 missing .*'model\.norm\.weight'; "
                                             r"1 unexpected \(not read\): 'unused'"):
        got = zf.gather_params(_init("llama", path, strict=False))
    want = saved_values("llama")
    assert torch.equal(got["model.norm.weight"], torch.ones(16))  # RMSNorm's init
    assert all(torch.equal(got[k], v) for k, v in want.items() if k != "model.norm.weight")


LLAMA_KEYS = sorted(build("llama").state_dict())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drop=st.sets(st.sampled_from(LLAMA_KEYS), min_size=1, max_size=len(LLAMA_KEYS) - 1),
       extra=st.sets(st.sampled_from(["unused", "model.layers.0.extra", "model.layers.9.mlp.up_proj.weight"])))
def test_strict_false_reports_what_load_state_dict_reports(saved, tmp_path_factory, drop, extra):
    """Any tensors missing and any extra: ``strict=False`` warns with the counts and names, and the
    warning's ``incompatible`` and the state's ``loading_info`` hold the keys
    ``load_state_dict(strict=False)`` returns for the same tensors."""
    src = saved("llama")
    path = rewrite_checkpoint(src, tmp_path_factory.mktemp("part"),
                    lambda t: {**{k: v for k, v in t.items() if k not in drop}, **{k: torch.zeros(2) for k in extra}})
    with pytest.warns(WeightsMismatch) as caught:
        state = _init("llama", path, strict=False)
        got = zf.gather_params(state)
    [warning] = [w.message for w in caught if isinstance(w.message, WeightsMismatch)]
    assert state.loading_info == warning.incompatible
    want = build("llama").load_state_dict(safetensors.load_file(os.path.join(path, "model.safetensors")), strict=False)
    assert sorted(warning.incompatible.missing_keys) == sorted(want.missing_keys) == sorted(drop)
    assert sorted(warning.incompatible.unexpected_keys) == sorted(want.unexpected_keys) == sorted(extra)
    assert f"{len(LLAMA_KEYS) - len(drop)} of the model's {len(LLAMA_KEYS)} tensors read; {len(drop)} missing" in str(warning)
    values = saved_values("llama")
    assert all(torch.equal(got[k], values[k]) for k in LLAMA_KEYS if k not in drop)


def test_loading_info_is_on_the_state_init_returns(saved):
    """Complete files: nothing missing, nothing unexpected; a state built without weights= and the
    states later steps return carry no report."""
    state = _init("llama", saved("llama"))
    assert state.loading_info == ([], []) and state.loading_info.missing_keys == []
    step = zf.train_step(lambda p, x: 0, zf.optim.adamw(LR))
    assert step.init(build("llama")).loading_info is None


@pytest.mark.parametrize("strict", [True, False])
def test_files_that_share_no_tensor_with_the_model_are_refused(saved, tmp_path, strict):
    """A peft model's names over a plain checkpoint (or any renaming): nothing would be read, so init
    refuses, naming the files' keys and the model's and what to do."""
    path = rewrite_checkpoint(saved("llama"), tmp_path / "renamed", lambda t: {f"base_model.model.{k}": v for k, v in t.items()})
    with pytest.raises(ValueError, match=r"share no tensor with the model: 21 tensors the files hold: "
                                         r"'base_model\.model\..*21 tensors the model needs: 'model\.embed_tokens"
                                         r".*load the files into the model they were saved from"):
        _init("llama", path, strict=strict)


# ------------------------------------------------- fused (Mixture-of-Experts) tensors

def init_error(kind: str, path: str) -> str:
    """The error ``step.init(build(kind, "meta"), weights=path)`` raises on this rank."""
    try:
        _init(kind, path).close()
    except ValueError as e:
        return str(e)
    return "no error"


def _file_keys(kind: str, src: str) -> list[str]:
    from zfunc.weights.safetensors_reader import tensors_of

    return sorted(k for k in tensors_of(src) if ".experts." in k)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10**6), how=st.sampled_from(["missing", "rows", "columns"]), strict=st.booleans())
def test_a_missing_or_misshaped_expert_is_named(kind, saved, tmp_path_factory, pick, how, strict):
    """Any one expert tensor missing or of another shape: the error names the tensor, its file (the one
    holding its siblings where it is missing) and the shape expected, on every rank."""
    src = saved(kind)
    keys = _file_keys(kind, src)
    key = keys[pick % len(keys)]
    from zfunc.weights.safetensors_reader import tensors_of

    expected = tensors_of(src)[key].shape

    def change(t):
        shape = t[key].shape
        if how == "missing":
            return {k: v for k, v in t.items() if k != key}
        bigger = (shape[0] + 1, shape[1]) if how == "rows" else (shape[0], shape[1] + 1)
        return {**t, key: torch.zeros(bigger)}

    path = rewrite_checkpoint(src, tmp_path_factory.mktemp("moe"), change)
    file = os.path.join(path, "model.safetensors")
    with pytest.raises(ValueError) as raised:
        _init(kind, path, strict=strict)
    text = str(raised.value)
    assert repr(key) in text and repr(file) in text, text
    assert (f"(shape {expected})" if how == "missing" else f"expected shape {expected}") in text, text


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_an_expert_error_is_raised_on_every_rank(kind, saved, tmp_path):
    src = saved(kind)
    key = _file_keys(kind, src)[-1]
    path = rewrite_checkpoint(src, tmp_path / "moe", lambda t: {k: v for k, v in t.items() if k != key})
    for text in workers(2).run(init_error, kind, path):
        assert f"tensor {key!r}" in text and "is missing" in text, text


def test_damaged_files_are_named(saved, tmp_path):
    src = saved("gpt2")
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    shard = sorted(set(index["weight_map"].values()))[-1]

    def copy(name: str) -> str:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return str(dst)

    truncated = copy("truncated")
    with open(os.path.join(truncated, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(src, shard)) - 100)
    with pytest.raises(ValueError, match=rf"{shard}' is truncated: tensor '[^']+' ends at byte"):
        _init("gpt2", truncated)
    header = copy("header")
    with open(os.path.join(header, shard), "r+b") as f:
        f.seek(8)
        f.write(b"#not json")
    with pytest.raises(ValueError, match=rf"{shard}' has a damaged header"):
        _init("gpt2", header)
    length = copy("length")
    with open(os.path.join(length, shard), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match=rf"{shard}' is truncated or damaged: its header length"):
        _init("gpt2", length)
    lost = copy("lost")
    os.remove(os.path.join(lost, shard))
    with pytest.raises(ValueError, match=rf"names file '{shard}', which is not in"):
        _init("gpt2", lost)
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        _init("gpt2", tmp_path)


# --------------------------------------------------------- buffers no file holds


class Rotary(nn.Module):
    """A module whose only tensor is a non-persistent buffer computed in __init__ from a config
    (as transformers' rotary embeddings), with no init of its own."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = Rotary({"dim": 8})
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.register_buffer("scale", torch.full((3,), 2.0))  # persistent: in the files


def test_buffers_the_files_lack_are_computed_as_the_module_computes_them(tmp_path):
    """A meta-built model: its non-persistent buffer is its module's __init__ computation (the
    module built again from its config), its persistent one read from the file."""
    model = WithBuffers()
    path = str(tmp_path / "m.safetensors")
    safetensors.save_file(model.state_dict(), path)
    with torch.device("meta"):
        meta = WithBuffers()
    state = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1))).init(meta, weights=path)
    assert torch.equal(state.buffers["rotary.inv_freq"], model.rotary.inv_freq)
    assert torch.equal(state.buffers["scale"], model.scale)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in zf.gather_params(state).items())


def test_a_buffer_no_init_fills_is_named():
    """No tensor of the state is left as uninitialized memory: a buffer init_fn does not fill, or
    one no module init can compute, raises naming it."""

    def fills_parameters_only(module):
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)

    step = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1)))
    with torch.device("meta"):
        model = nn.Sequential(nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"0\.running_mean, 0\.running_var, 0\.num_batches_tracked of module 0 "
                                         r"\(BatchNorm1d\) .* left uninitialized by init_fn"):
        step.init(model, init_fn=fills_parameters_only)

    class NoConfig(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        model = nn.ModuleDict({"table": NoConfig(), "lin": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"table\.table of module table \(NoConfig\) .* left uninitialized"):
        step.init(model)


# ------------------------------------------------------------------ memory


def load_peak(path: str, warm: str) -> dict:
    """Peak RSS above the baseline while a meta-built Llama is read from ``path`` under
    zero3(offload_nvme) at W = 1 (VmHWM, reset just before init; a fresh process). The tiny
    model at ``warm`` is read first, the same way, so the code and native ops are loaded."""
    def nvme(model, weights, swap):
        step = zf.zero3(zf.offload_nvme(zf.train_step(lambda p, x: 0, zf.optim.adamw(LR)), swap))
        return step.init(model, weights=weights)

    nvme(build("llama", "meta"), warm, path + "-warm").close()
    model = build_medium("meta")
    before = memory.rss()
    memory.reset_peak()
    state = nvme(model, path, path + "-swap")
    peak = memory.peak() - before
    units = [u.trainable.numel for u in state.params.spec.model.units]
    state.close()
    return {"peak": peak, "fp32": 4 * sum(units), "unit": 4 * max(units)}


def build_medium(device: str) -> nn.Module:
    """A Llama of 31.6M parameters: 10 layers of width 512, a 4096-token tied vocabulary."""
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=10,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


@pytest.mark.slow
def test_loading_a_larger_model_holds_about_a_unit(saved, tmp_path):
    """A 31.6M-parameter Llama (121 MiB in fp32) read under zero3(offload_nvme) at W = 1 in a fresh
    process: peak RSS above the baseline stays under 4 of its largest unit (11 MiB) plus 24 MiB and
    under half the fp32 size. Measured: 45 MiB, as meta-device init without weights (offload_nvme's
    per-unit init: its staging write and Adam's moments); a hand-written init_fn copying from
    load_file held 167 MiB (benchmarks/load_weights.py)."""
    with torch.device("meta"):
        shapes = build_medium("meta").state_dict()
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(v.shape, generator=g) * 0.02 for k, v in shapes.items() if k != "lm_head.weight"}
    path = str(tmp_path / "model.safetensors")
    safetensors.save_file(tensors, path)
    del tensors
    with fresh_workers(1) as group:
        [r] = group.run(load_peak, path, saved("llama"))
    assert r["peak"] < 4 * r["unit"] + (24 << 20), r
    assert r["peak"] < r["fp32"] / 2, r
