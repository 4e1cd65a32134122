"""save_hf on a peft model (zfunc.checkpoint.peft_export): the adapters as ``PeftModel.save_pretrained``
writes them, and ``merged=True`` the model ``merge_and_unload()`` gives.

The oracles are peft and transformers: a plain peft model in memory holding the trained state's values
(``zf.gather_params``) saves its adapters with ``save_pretrained``; zfunc's folder must hold the same
tensors under the same names and the same ``adapter_config.json``, ``PeftModel.from_pretrained(base,
dir)`` must give the plain model's logits, and the merged folder must load in the base class's
``from_pretrained`` with no missing or unexpected key, every tensor equal to ``merge_and_unload()``'s.
"""
import json
import os

import peft
import pytest
import safetensors.torch as safetensors
import torch

import zfunc as zf
from compositions import compose
from hf import LR, build, tokens
from peft_models import make_peft
from workers import workers

import transformers  # noqa: E402

def train_and_save(kind: str, method: str, how: str, base: str, out: str, steps: int = 2) -> dict:
    """On each rank: the meta-built peft model read from ``base`` under ``how``, ``steps`` steps, then its
    adapters saved to ``out/adapter`` and the merged model to ``out/merged`` (every rank calls save_hf)."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = make_peft(kind, method)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = compose(how, zf.train_step(loss_fn, zf.optim.adamw(1e-2)), os.path.join(out, f"swap-{rank}"))
    with step.init(model, weights=base) as state:
        for i in range(steps):
            state, _ = step(state, tokens(2 * world, seed=i)[2 * rank: 2 * rank + 2])
        zf.checkpoint.save_hf(state, os.path.join(out, "adapter"), model=model)
        zf.checkpoint.save_hf(state, os.path.join(out, "merged"), model=model, merged=True, max_shard_size="20KB")
        if method == "two":  # one adapter of two: its subfolder only, as save_pretrained(selected_adapters=)
            zf.checkpoint.save_hf(state, os.path.join(out, "selected"), model=model, selected_adapters=["other"])
        return zf.gather_params(state)


def plain_peft(kind: str, method: str, params: dict):
    """The plain peft model in memory holding ``params`` (the trained state's values)."""
    model = make_peft(kind, method, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def adapter_tensors(folder) -> dict:
    return safetensors.load_file(os.path.join(folder, "adapter_model.safetensors"))


def config_of(folder) -> dict:
    """adapter_config.json, its lists of names sorted (peft writes its sets, as target_modules, as lists
    in the set's order, which differs between processes)."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    return {k: sorted(v) if isinstance(v, list) and all(isinstance(e, str) for e in v) else v
            for k, v in config.items()}


def check_adapters(folder, plain, base, tmp_path) -> None:
    """Each adapter's folder holds what the plain model's save_pretrained writes (tensors, names, config),
    and loads in peft over ``base`` (the trained state's base: under bf16 its stored, rounded values)
    into the plain model's logits."""
    plain.save_pretrained(str(tmp_path / "reference"))
    adapters = list(plain.peft_config)
    for adapter in adapters:
        sub = "" if adapter == "default" else adapter
        got, want = adapter_tensors(folder / sub), adapter_tensors(tmp_path / "reference" / sub)
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items()), adapter
        assert not any(".base_layer." in k or k.endswith("original_module.weight") for k in got)
        assert config_of(folder / sub) == config_of(tmp_path / "reference" / sub)
        assert not [e for e in os.listdir(folder / sub) if ".tmp-" in e]
    loaded = peft.PeftModel.from_pretrained(base, str(folder))
    for adapter in adapters[1:]:
        loaded.load_adapter(str(folder / adapter), adapter)
    if len(adapters) > 1:
        loaded.base_model.set_adapter(adapters)
    x = tokens(3, seed=7)
    assert torch.equal(loaded(input_ids=x).logits, plain(input_ids=x).logits)


def check_merged(folder, plain) -> None:
    """The merged folder loads in the base class's from_pretrained, no key missing or unexpected, each
    tensor merge_and_unload()'s, and the merge changed the adapted weights."""
    base = {k: v.clone() for k, v in plain.base_model.model.state_dict().items() if ".base_layer." in k}
    merged = plain.merge_and_unload()
    model, info = type(merged).from_pretrained(str(folder), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got, want = model.state_dict(), merged.state_dict()
    assert set(got) == set(want)
    assert not [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert base and all(not torch.equal(got[k.replace(".base_layer.", ".")], v) for k, v in base.items()
                        if k.endswith(".weight"))
    assert len([e for e in os.listdir(folder) if e.endswith(".safetensors")]) > 1  # written unit by unit, sharded


_bases: dict = {}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    def get(kind: str) -> str:
        if kind not in _bases:
            _bases[kind] = str(tmp_path_factory.mktemp(f"base-{kind}"))
            build(kind).save_pretrained(_bases[kind])
        return _bases[kind]

    return get


CASES = [("llama", "lora", "zero3", 2), ("gpt2", "dora", "zero3", 1),  # fast: LoRA (modules_to_save), DoRA
         ("llama", "two", "zero3", 1), ("gpt2", "ia3", "zero1", 2), ("qwen2", "lora", "zero3", 3),
         ("llama", "dora", "bf16", 2), ("gpt2", "lora", "offload_nvme", 2), ("qwen2", "two", "zero3", 2)]
FAST = 1


@pytest.mark.parametrize("kind,method,how,world", [c if i < FAST else pytest.param(*c, marks=pytest.mark.slow)
                                                   for i, c in enumerate(CASES)],
                         ids=[f"{k}-{m}-{h}-W{w}" for k, m, h, w in CASES])
def test_adapters_and_merged_model_are_what_peft_writes(kind, method, how, world, base, tmp_path):
    """Trained under ``how`` at W ranks: the adapters (each adapter of the model, the second in its
    subfolder) are byte for byte peft's, reload in peft to the same logits; the merged model is
    merge_and_unload()'s."""
    params = workers(world).run(train_and_save, kind, method, how, base(kind), str(tmp_path))[0]
    check_adapters(tmp_path / "adapter", plain_peft(kind, method, params), plain_peft(kind, method, params).unload(),
                   tmp_path)
    check_merged(tmp_path / "merged", plain_peft(kind, method, params))
    if method == "two":
        assert os.listdir(tmp_path / "selected") == ["other"]
        got, want = adapter_tensors(tmp_path / "selected" / "other"), adapter_tensors(tmp_path / "adapter" / "other")
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_save_hf_refuses_what_it_would_write_wrong(base, tmp_path):
    """A peft state without model= is refused (its names load nowhere); merged= for a model that is no
    peft model; config= for the adapters; an adapter that is not the model's; another model's files
    beside the adapter are refused, then removed with overwrite=True; a second save replaces the first."""
    model = make_peft("llama", "lora")
    step = zf.train_step(lambda p, x: zf.apply(model, p, input_ids=x, labels=x).loss, zf.optim.adamw(LR))
    state = step.init(model, weights=base("llama"))
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"this state is a peft model's .* pass model=, the PeftModel"):
        zf.checkpoint.save_hf(state, out)
    with pytest.raises(ValueError, match=r"config= is for the model's config\.json \(merged=True\)"):
        zf.checkpoint.save_hf(state, out, model=model, config={"a": 1})
    with pytest.raises(ValueError, match=r"selected_adapters=\['nope'\]: the model's adapters are \['default'\]"):
        zf.checkpoint.save_hf(state, out, model=model, selected_adapters=["nope"])
    with pytest.raises(ValueError, match=r"state was built for a different model"):
        zf.checkpoint.save_hf(state, out, model=make_peft("gpt2", "lora"))
    assert not os.path.exists(out)
    plain = build("llama")
    plain_state = zf.train_step(lambda p, x: 0, zf.optim.adamw(LR)).init(plain)
    with pytest.raises(ValueError, match=r"merged= and selected_adapters= are for a peft model"):
        zf.checkpoint.save_hf(plain_state, out, model=plain, merged=True)
    zf.checkpoint.save_hf(plain_state, out, config=plain.config)  # a whole model in the folder
    with pytest.raises(FileExistsError, match=r"holds another model's files .*\{'\.': \['config\.json', 'model\.safetensors'\]\}"):
        zf.checkpoint.save_hf(state, out, model=model)
    assert "adapter_config.json" not in os.listdir(out)
    zf.checkpoint.save_hf(state, out, model=model, overwrite=True)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    first = adapter_tensors(out)
    state, _ = step(state, tokens(2))
    zf.checkpoint.save_hf(state, out, model=model)  # its own files: replaced without overwrite=
    second = adapter_tensors(out)
    assert set(first) == set(second) and any(not torch.equal(first[k], second[k]) for k in first)
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["peft_type"] == "LORA"
    with pytest.raises(FileExistsError, match=r"adapter_config\.json"):  # the merged model beside an adapter
        zf.checkpoint.save_hf(state, out, model=model, merged=True)
    state.close()


def test_what_cannot_be_written_unit_by_unit_is_refused_naming_it(base, tmp_path, monkeypatch):
    """A LoRA layer whose adapter is a unit of its own apart from its base weight cannot be merged one
    unit at a time: refused naming the layer (its adapter still saves); a tensor peft's state dict
    computes instead of taking from the model is refused, naming it."""
    model = make_peft("llama", "lora")
    step = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.adamw(LR)),
                    units=lambda name, m: name.endswith("layers.0") or name.endswith("layers.1.self_attn.q_proj.lora_A.default"))
    with step.init(model, weights=base("llama")) as state:
        with pytest.raises(ValueError, match=r"merged=True: peft layer model\.layers\.1\.self_attn\.q_proj \(Linear\) "
                                             r"has tensors in units \[0, 2\]"):
            zf.checkpoint.save_hf(state, str(tmp_path / "merged"), model=model, merged=True)
        assert not os.path.exists(tmp_path / "merged")
        zf.checkpoint.save_hf(state, str(tmp_path / "adapter"), model=model)
        want = {k.replace(".modules_to_save", "").replace(".default", ""): v for k, v in zf.gather_params(state).items()
                if "lora_" in k or "modules_to_save" in k}
        got = adapter_tensors(tmp_path / "adapter")
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
        real = peft.utils.get_peft_model_state_dict

        def computed(*args, **kwargs):
            out = real(*args, **kwargs)
            return {**out, "base_model.model.extra": torch.zeros(2)}

        monkeypatch.setattr(peft.utils, "get_peft_model_state_dict", computed)
        with pytest.raises(ValueError, match=r"holds 'base_model\.model\.extra', which it computed rather than took"):
            zf.checkpoint.save_hf(state, str(tmp_path / "computed"), model=model)
