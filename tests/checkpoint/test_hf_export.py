"""Export to Hugging Face (zf.checkpoint.save_hf, export_hf, ``python -m zfunc.checkpoint export-hf``).

The oracles are transformers and safetensors themselves: ``from_pretrained`` must load the
folder with no missing, unexpected or mismatched keys, into exactly ``zf.gather_params`` cast
to the dtype written (bit for bit); the names written must be the ones ``save_pretrained``
writes for the same model (tied weights once, under the name it keeps; no non-persistent
buffers); every shard must be byte for byte the file ``safetensors.torch.save_file`` writes for
its tensors; the split must be huggingface_hub's.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import weakref

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

import zfunc as zf
from zfunc.checkpoint import hf_export, hf_files, stream
from models import batch, build, local, loss
from workers import workers

import transformers  # noqa: E402  the [test] extra installs it
import safetensors.torch as safetensors  # noqa: E402
from hf import gpt2_config, llama_config, qwen2_config  # noqa: E402
SHARD = 3000  # bytes: every model here is written in several shards
HF_KEYS: dict[str, set] = {}


def hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":  # tied head; Conv1D weights
        return transformers.GPT2LMHeadModel(gpt2_config())
    if kind == "llama":  # untied head; rotary inv_freq, a non-persistent buffer
        return transformers.LlamaForCausalLM(llama_config())
    if kind == "qwen2":  # tied head; q/k/v biases
        return transformers.Qwen2ForCausalLM(qwen2_config(tie_word_embeddings=True))
    # T5: one weight under four names (shared, both embed_tokens, lm_head)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def auto_class(kind: str):
    return transformers.AutoModelForSeq2SeqLM if kind == "t5" else transformers.AutoModelForCausalLM


def tokens(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, 50, (size, 8), generator=torch.Generator().manual_seed(step))


def compose(how: str, step, swap: str):
    if how == "zero3_nvme":
        return zf.zero3(zf.offload_nvme(step, swap))
    if how == "bf16":
        return zf.zero3(zf.mixed_precision(step, torch.bfloat16))
    if how == "offload_cpu":
        return zf.zero3(zf.offload_cpu(step))
    return zf.zero3(step)


def config_as(form: str, config, folder: str):
    """``config`` in one of the forms save_hf takes (written under ``folder`` for the path forms)."""
    if form == "object":
        return config
    if form == "dict":
        return config.to_dict()
    os.makedirs(folder, exist_ok=True)
    if form == "folder":
        config.save_pretrained(folder)
        return folder
    path = os.path.join(folder, "config.json")
    config.to_json_file(path)
    return path


def train_and_export(kind: str, how: str, directory: str, form: str) -> dict:
    """Two steps of ``kind`` under ``how``, then a checkpoint and an export of the live state."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = hf_model(kind)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = compose(how, zf.train_step(loss_fn, zf.optim.adamw(1e-2)), os.path.join(directory, "swap"))
    with step.init(model) as state:
        for i in range(2):
            state, _ = step(state, tokens(i, 2 * world)[2 * rank: 2 * rank + 2])
        zf.checkpoint.save(state, os.path.join(directory, "ckpt"), "t")
        config = config_as(form, model.config, os.path.join(directory, f"config-live-{rank}"))
        zf.checkpoint.save_hf(state, os.path.join(directory, "live"), max_shard_size=SHARD, config=config)
        return zf.gather_params(state)


def hf_keys(kind: str, tmp) -> set:
    """The names ``save_pretrained`` writes for ``kind``."""
    if kind not in HF_KEYS:
        hf_model(kind).save_pretrained(tmp / f"hf-{kind}")
        HF_KEYS[kind] = set(written(tmp / f"hf-{kind}"))
    return HF_KEYS[kind]


def written(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, checking each file's metadata and bytes."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            with safetensors.safe_open(path, "pt") as f:
                assert f.metadata() == {"format": "pt"}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            again = os.path.join(folder, "again.bin")
            safetensors.save_file(tensors, again, metadata={"format": "pt"})
            with open(path, "rb") as a, open(again, "rb") as b:
                assert a.read() == b.read(), f"{name} is not what safetensors writes for its tensors"
            os.remove(again)
            assert not out.keys() & tensors.keys()
            out.update(tensors)
    return out


def check_shards(folder, tensors: dict, max_bytes: int) -> None:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    n = len(names)
    assert n > 1 and names == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    nbytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values())
    assert set(index["weight_map"]) == set(tensors)
    for name in names:
        held = [k for k, v in index["weight_map"].items() if v == name]
        assert len(held) == 1 or sum(nbytes[k] for k in held) <= max_bytes
    assert not [n for n in os.listdir(folder) if ".tmp-" in n]


def check_export(folder, kind: str, params: dict, dtype: torch.dtype, tmp) -> None:
    """``folder`` holds what save_pretrained writes for ``kind``, and loads into ``params`` in ``dtype``."""
    tensors = written(folder)
    assert set(tensors) == hf_keys(kind, tmp)  # tied weights once, under HF's name; no inv_freq
    assert "lm_head.weight" not in tensors or kind == "llama"
    check_shards(folder, tensors, SHARD)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["dtype"] == str(dtype).removeprefix("torch.")
    model, info = auto_class(kind).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    for name, value in params.items():
        assert state[name].dtype == dtype and torch.equal(state[name], value.to(dtype)), name
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert "lm_head.weight" in params or torch.equal(head, embedding)  # tied: the embedding, written once


CASES = [  # model, composition, world size, config's form live and from the checkpoint, export dtype
    ("gpt2", "zero3", 2, "object", "dict", None),
    ("llama", "zero3_nvme", 2, "folder", "json", None),
    ("qwen2", "bf16", 2, "dict", "object", torch.bfloat16),
    ("llama", "offload_cpu", 1, "json", "folder", torch.bfloat16),
    ("t5", "zero3", 1, "object", "folder", None),
]


@pytest.mark.parametrize("kind,how,world,live_form,saved_form,dtype", CASES)
def test_exports_load_in_transformers_and_equal_gather_params(kind, how, world, live_form, saved_form, dtype,
                                                              tmp_path):
    """From the live state (every rank gathers, rank 0 writes) and from its checkpoint, saved at W and
    exported here in one process: what save_pretrained writes, loaded into gather_params' values.
    Under bf16 mixed precision the default dtype is the model's (fp32): the master weights."""
    params = workers(world).run(train_and_export, kind, how, str(tmp_path), live_form)[0]
    check_export(tmp_path / "live", kind, params, torch.float32, tmp_path)
    config = config_as(saved_form, hf_model(kind).config, str(tmp_path / "config-saved"))
    zf.checkpoint.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "saved"), dtype=dtype, max_shard_size=SHARD,
                            config=config)
    check_export(tmp_path / "saved", kind, params, dtype or torch.float32, tmp_path)


def frozen_and_buffers(directory: str) -> tuple[dict, dict]:
    """A model with frozen parameters and BatchNorm statistics (an int64 one among them), trained
    two steps at W, exported; not a transformers model."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build("frozen_bn")
    step = zf.zero3(zf.train_step(lambda p, b: loss("frozen_bn", zf.apply(model, p, b[0]), b[1]),
                                  zf.optim.adamw(1e-2)))
    state = step.init(model)
    for i in range(2):
        state, _ = step(state, local(batch("frozen_bn", model, i, 4), rank, world))
    zf.checkpoint.save_hf(state, directory, max_shard_size=200)
    return zf.gather_params(state), {k: v.clone() for k, v in state.buffers.items()}


def test_frozen_parameters_and_persistent_buffers_of_any_model(tmp_path):
    params, buffers = workers(2).run(frozen_and_buffers, str(tmp_path))[0]
    tensors = written(tmp_path)
    check_shards(tmp_path, tensors, 200)
    fresh = build("frozen_bn", seed=1)
    fresh.load_state_dict(tensors)  # strict: the state_dict's names exactly
    for name, value in {**params, **buffers}.items():
        assert torch.equal(tensors[name], value), name


def test_splits_and_sizes_as_huggingface_hub(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int

    for size in ("5GB", "500MB", "100KB", "1.5GB", "2TB"):
        assert hf_files.parse_size(size) == parse_size_to_int(size)
    assert hf_files.parse_size(1234) == hf_files.parse_size("1234") == 1234
    with pytest.raises(ValueError, match="KB, MB, GB or TB"):
        hf_files.parse_size("5 gigs")
    sizes = [6, 6, 2, 6, 2, 2, 11, 3, 10, 1]  # elements of fp32; the hub documents [6], [6+2], [6+2+2]
    state = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    ours = hf_files.split([hf_files.Planned(k, tuple(v.shape), v.dtype) for k, v in state.items()], 40)
    theirs = split_torch_state_dict_into_shards(state, max_shard_size=40)
    assert [[t.name for t in shard] for shard in ours] == list(theirs.filename_to_tensors.values())


def export_streaming(directory: str) -> int:
    """save_hf of an NVMe-offloaded state at W = 2, each gathered unit checked to be the only one alive."""
    model = hf_model("llama")
    step = zf.zero3(zf.offload_nvme(zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss,
                                                  zf.optim.adamw(1e-3)), os.path.join(directory, "swap")))
    original, alive = stream.unit_values, []

    def spy(params, i):
        assert all(ref() is None for ref in alive), "a unit gathered before is still in memory"
        out = original(params, i).clone()  # held by the export alone (gloo's thread may hold the gathered one a while)
        alive.append(weakref.ref(out))
        return out

    stream.unit_values = spy  # where save_hf's units are gathered (the weights' stream)
    try:
        with step.init(model) as state:
            zf.checkpoint.save_hf(state, os.path.join(directory, "out"), max_shard_size=SHARD)
    finally:
        stream.unit_values = original
    return len(alive)


def test_one_unit_in_memory_at_a_time(tmp_path, monkeypatch):
    """Each unit's gathered buffer (live state) or joined shards (checkpoint) is gone before the next
    is made."""
    assert workers(2).run(export_streaming, str(tmp_path))[0] == 3  # the root unit and two layers
    model = hf_model("llama")
    with zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1))).init(model) as state:
        zf.checkpoint.save(state, str(tmp_path / "ckpt"), "t")
    original, alive = zf.checkpoint.Saved.unit, []

    def spy(saved, role, i):
        assert all(ref() is None for ref in alive), "a unit read before is still in memory"
        out = original(saved, role, i)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(zf.checkpoint.Saved, "unit", spy)
    zf.checkpoint.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "saved"))
    assert len(alive) == 3


CLI = textwrap.dedent("""
    import runpy, sys
    import zfunc
    from zfunc.testing import memory

    base = memory.rss()
    sys.argv = ["python -m zfunc.checkpoint"] + sys.argv[1:]
    try:
        runpy.run_module("zfunc.checkpoint", run_name="__main__", alter_sys=True)  # what python -m runs
    except SystemExit as e:
        assert not e.code, e.code
    print(memory.peak() - base)
""")


@pytest.mark.slow
def test_the_cli_exports_a_checkpoint_holding_one_unit_not_the_model(tmp_path):
    """``python -m zfunc.checkpoint export-hf`` in a fresh process, on a 21.2M-parameter Llama (85 MB in
    fp32; 12 layers of 7.1 MB and a 0.8 MB root unit): the peak RSS rises by less than four layers, a
    third of the model (measured: 2.7 layers, 19 MB: the unit read, the file's pages it came from, the
    bf16 copies being written and the allocator's slack), and from_pretrained loads the bf16 folder."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
                                      num_attention_heads=6, num_key_value_heads=6)
    model = transformers.LlamaForCausalLM(config)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    with zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1))).init(model) as state:
        params = zf.gather_params(state)
        zf.checkpoint.save(state, str(tmp_path / "ckpt"), "t")
    config.save_pretrained(tmp_path / "config")
    proc = subprocess.run([sys.executable, "-c", CLI, "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                           "--dtype", "bf16", "--max-shard-size", "30MB", "--config", str(tmp_path / "config")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.split()[-1])
    assert peak < 4 * layer, f"peak RSS rose by {peak / layer:.1f} layers exporting a {nbytes / layer:.0f}-layer model"
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = tuned.state_dict()
    assert all(torch.equal(state[k], v.bfloat16()) for k, v in params.items())
    print(f"peak RSS +{peak / 1e6:.1f} MB ({peak / layer:.2f} layers) for a {nbytes / 1e6:.0f} MB model")


def agreement(directory: str) -> str:
    model = build("gpt")
    step = zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1)))
    state = step.init(model)
    try:
        zf.checkpoint.save_hf(state, directory, config=42)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_error_on_rank_0_is_raised_on_every_rank(tmp_path):
    first, second = workers(2).run(agreement, str(tmp_path))
    assert first.startswith("TypeError: config must be") and "PretrainedConfig" in first
    assert second.startswith("RuntimeError: rank 0 could not write")


def test_a_new_export_replaces_the_old_one_and_a_failed_one_changes_nothing(tmp_path, monkeypatch):
    """With overwrite=True the other split's shards and index go, but only once the new weights are
    complete: a failed export leaves the old folder as it was."""
    model = build("gpt")
    with zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1))).init(model) as state:
        params = zf.gather_params(state)
        zf.checkpoint.save_hf(state, str(tmp_path), max_shard_size=100)
        assert len(written(tmp_path)) == len(params)  # the tied head once
        with pytest.raises(FileExistsError, match="model.safetensors.index.json"):  # they would stay
            zf.checkpoint.save_hf(state, str(tmp_path))
        zf.checkpoint.save_hf(state, str(tmp_path), overwrite=True)  # one file: the shards and the index go
        assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]

        def fail(self, name, value):
            raise OSError(5, "injected")

        monkeypatch.setattr(hf_files.SafetensorsFile, "put", fail)
        with pytest.raises(OSError, match="injected"):
            zf.checkpoint.save_hf(state, str(tmp_path), max_shard_size=100, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temporary file left
    tensors = written(tmp_path)
    assert tensors.keys() == params.keys() and all(torch.equal(tensors[k], v) for k, v in params.items())


def test_consolidate_safetensors_is_the_exported_file(tmp_path):
    """``consolidate --safetensors`` writes the single file export-hf writes, in fp32."""
    model = build("gpt")
    with zf.zero3(zf.mixed_precision(zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1)), torch.bfloat16)).init(
            model) as state:
        zf.checkpoint.save(state, str(tmp_path / "ckpt"), "t")
    saved = zf.checkpoint.Saved(zf.checkpoint.resolve(str(tmp_path / "ckpt")))
    hf_export.safetensors_from_saved(saved, str(tmp_path / "one.safetensors"), torch.float32)
    zf.checkpoint.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "folder"), dtype=torch.float32)
    with open(tmp_path / "one.safetensors", "rb") as a, open(tmp_path / "folder" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()
    assert not re.search(r"\.tmp-", " ".join(os.listdir(tmp_path)))


def test_the_finetune_example_loads_trains_and_exports(tmp_path, monkeypatch, capsys):
    """examples/hf_finetune.py (run here, not in a new process: imports are most of its time): a random
    Llama written with save_pretrained, built on the meta device, loaded through weights=, two steps
    under zero3 with CPU offload, exported in several shards and loaded back."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_finetune.py")
    spec = importlib.util.spec_from_file_location("hf_finetune", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    example.main(example.parser.parse_args(["--steps", "2", "--mb", "0.1", "--seq", "32", "--zero3", "--offload-cpu",
                                            "--max-shard-size", "100KB", "--out", str(tmp_path / "tuned")]))
    assert "from_pretrained loads it, equal to the trained weights" in capsys.readouterr().err
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "tuned")


# Files another model leaves in a folder (from_pretrained or peft would read them), and a user's others.
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00003.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "adapter_config.json",
               "adapter_model.safetensors", "adapter_model.bin"]
USER_FILES = ["README.md", "tokenizer.json", "tokenizer_config.json", "training_args.bin", "notes.txt"]


def _contents(folder) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=st.sets(st.sampled_from(MODEL_FILES)), user=st.sets(st.sampled_from(USER_FILES)),
       with_config=st.booleans(), shards=st.sampled_from([None, 100]))
def test_another_models_files_are_refused_or_removed(old, user, with_config, shards, tmp_path_factory):
    """A model file the export would leave beside its own (not one it writes anew) is refused, the
    folder untouched; with overwrite=True removed; a user's other files are kept either way."""
    tmp = tmp_path_factory.mktemp("hf")
    model = build("gpt")
    config = {"model_type": "gpt2", "n_embd": 16} if with_config else None
    kw = dict(config=config) | ({} if shards is None else {"max_shard_size": shards})
    with zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1))).init(model) as state:
        zf.checkpoint.save_hf(state, str(tmp / "fresh"), **kw)
        fresh = _contents(tmp / "fresh")
        folder = tmp / "out"
        folder.mkdir()
        for name in sorted(old | user):
            (folder / name).write_bytes(b"another model's " + name.encode())
        before = _contents(folder)
        stale = sorted(old - fresh.keys())
        if stale:
            with pytest.raises(FileExistsError, match=re.escape(str(stale))):
                zf.checkpoint.save_hf(state, str(folder), **kw)
            assert _contents(folder) == before  # nothing written, nothing removed
            zf.checkpoint.save_hf(state, str(folder), overwrite=True, **kw)
        else:  # only files it writes anew, or none: no overwrite needed
            zf.checkpoint.save_hf(state, str(folder), **kw)
    assert _contents(folder) == fresh | {n: before[n] for n in user}


def export_over(directory: str, overwrite: bool) -> tuple[str, dict]:
    """save_hf of a trained Llama, with its config, into ``directory`` at W: the error, or the parameters."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = hf_model("llama")
    step = zf.zero3(zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss, zf.optim.sgd(0.1)))
    with step.init(model) as state:
        state, _ = step(state, tokens(0, 2 * world)[2 * rank: 2 * rank + 2])
        try:
            zf.checkpoint.save_hf(state, directory, config=model.config, overwrite=overwrite)
        except Exception as e:
            return f"{type(e).__name__}: {e}", {}
        return "", zf.gather_params(state)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_folder_of_another_model_saved_by_save_pretrained(world, tmp_path):
    """Qwen2 saved by save_pretrained in 11 shards with its generation config, a README and a tokenizer
    config beside: save_hf of a Llama (one file) refuses it on every rank, then with overwrite=True
    leaves a folder from_pretrained loads as that Llama alone, the user's files kept."""
    folder = tmp_path / "out"
    hf_model("qwen2").save_pretrained(folder, max_shard_size="3KB")
    (folder / "README.md").write_text("# my model\n")
    (folder / "tokenizer_config.json").write_text("{}\n")
    before = _contents(folder)
    assert len([n for n in before if n.startswith("model-")]) > 2 and "generation_config.json" in before
    results = workers(world).run(export_over, str(folder), False)
    assert results[0][0].startswith("FileExistsError") and "generation_config.json" in results[0][0]
    assert "model-00011-of-00011.safetensors" in results[0][0] and "Pass overwrite=True" in results[0][0]
    assert all(r[0].startswith("RuntimeError: rank 0 could not write") for r in results[1:])
    assert _contents(folder) == before
    (_, params), *_ = workers(world).run(export_over, str(folder), True)
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors", "tokenizer_config.json"]
    assert (folder / "README.md").read_text() == "# my model\n"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in params.items())


def test_export_hf_and_the_cli_refuse_a_config_they_would_leave(tmp_path, capsys):
    """Without --config an old config.json would describe the new weights: export-hf refuses, saying
    how to go on; --overwrite removes it (the folder then holds the weights alone)."""
    model = build("gpt")
    with zf.zero3(zf.train_step(lambda p, b: 0, zf.optim.sgd(0.1))).init(model) as state:
        zf.checkpoint.save(state, str(tmp_path / "ckpt"), "t")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}\n')
    with pytest.raises(FileExistsError, match=r"\['config.json'\] \(give config= to write config.json anew\)"):
        zf.checkpoint.export_hf(str(tmp_path / "ckpt"), str(out))
    with pytest.raises(FileExistsError, match="--overwrite"):
        zf.checkpoint.main(["export-hf", str(tmp_path / "ckpt"), str(out)])
    assert sorted(os.listdir(out)) == ["config.json"]
    assert zf.checkpoint.main(["export-hf", str(tmp_path / "ckpt"), str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    (out / "config.json").write_text('{"model_type": "llama"}\n')  # with a config given, it is written anew
    zf.checkpoint.export_hf(str(tmp_path / "ckpt"), str(out), config={"model_type": "gpt2"})
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
