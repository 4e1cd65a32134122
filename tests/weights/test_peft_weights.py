"""A peft model built on the meta device, its base read from the base model's own folder.

``get_peft_model`` renames the base tensors (``base_model.model.`` prefix, ``base_layer`` infix,
``modules_to_save`` copies); ``step.init(peft_model, weights=BASE_FOLDER)`` reads each of them bit for
bit, and peft's own init makes the adapters (lora_B zero, lora_A kaiming-uniform, DoRA's magnitude the
base weight's norm; ia3_l ones), or an adapter folder holds them.
Training under zero3 equals plain peft training of ``from_pretrained`` + ``get_peft_model`` started
from the same adapter values; only the adapters carry optimizer state."""
import math

import optree
import peft
import pytest
import torch

import zfunc as zf
from assertions import assert_close_to
from hf import LR, build, rewrite_checkpoint, tokens
from peft_models import TARGETS, is_adapter, meta_peft, peft_config
from workers import workers

import transformers  # noqa: E402

def train_zero3(kind: str, method: str, path: str, steps: int, per_rank: int = 2) -> dict:
    """On each rank: the peft model built on the meta device, its state read from ``path`` under zero3,
    then ``steps`` AdamW steps on this rank's part of the batch."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = meta_peft(kind, method)

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = zf.zero3(zf.train_step(loss_fn, zf.optim.adamw(LR)))
    state = step.init(model, weights=path)
    out = {"loaded": zf.gather_params(state), "losses": []}
    x = tokens(per_rank * world)[rank * per_rank : (rank + 1) * per_rank]
    for _ in range(steps):
        state, metrics = step(state, x)
        out["losses"].append(float(metrics["loss"]))
    out["stepped"] = zf.gather_params(state)
    state.close()
    return out


def plain_peft(kind: str, method: str, path: str, start: dict, steps: int, size: int) -> dict:
    """Plain peft: ``from_pretrained`` + ``get_peft_model`` in RAM, its trainable tensors set to
    ``start``'s (the RNGs of the two inits differ), then ``steps`` AdamW steps on the whole batch."""
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    base.config.use_cache = False
    model = peft.get_peft_model(base, peft_config(kind, method))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(start[k])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    x = tokens(size)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {"base": before,
            "stepped": {k: v.detach().clone() for k, v in model.named_parameters()}}


def assert_peft_init(method: str, loaded: dict) -> None:
    """The adapters as peft initializes them: lora_B exact zeros, lora_A kaiming-uniform
    (bound 1/sqrt(fan_in), filling it) or gaussian (std 1/r); ia3_l exact ones."""
    adapters = {k: v for k, v in loaded.items() if is_adapter(k)}
    assert adapters
    for k, v in adapters.items():
        if "lora_B" in k:
            assert torch.equal(v, torch.zeros_like(v)), k
        elif "lora_A" in k:
            if method == "gaussian":
                assert 0.1 < v.std().item() < 0.45, (k, v.std())  # std 1 / r = 0.25
            else:
                bound = 1 / math.sqrt(v.shape[1])
                assert v.abs().max() <= bound and v.abs().max() > 0.7 * bound, k
                assert v.std() > 0.3 * bound, k  # uniform: std = bound / sqrt(3)
        elif "ia3_l" in k:
            assert torch.equal(v, torch.ones_like(v)), k
        else:
            assert "lora_magnitude_vector" in k and v.min() > 0, k


CASES = [("llama", "lora", 2), ("gpt2", "dora", 1), ("gpt2", "ia3", 1), ("gpt2", "lora", 1), ("qwen2", "lora", 2),
         ("llama", "ia3", 2), ("qwen2", "gaussian", 1), ("gpt2", "lora", 3), ("llama", "dora", 2)]
FAST = 2  # the first cases; the others are slow (each family and method at W = 1, 2 and 3 between them)


@pytest.mark.parametrize("kind,method,world", [c if i < FAST else pytest.param(*c, marks=pytest.mark.slow)
                                               for i, c in enumerate(CASES)],
                         ids=[f"{k}-{m}-W{w}" for k, m, w in CASES])
def test_peft_on_meta_loads_its_base_and_trains_like_plain_peft(kind, method, world, folder):
    """Every base tensor (``base_layer``, ``modules_to_save`` copies, tied embeddings) equals the
    folder's bit for bit, the adapters are peft's init, and 2 zero3 steps equal plain peft's."""
    path, steps = folder(kind), 2
    results = workers(world).run(train_zero3, kind, method, path, steps)
    loaded = results[0]["loaded"]
    plain = plain_peft(kind, method, path, loaded, steps, 2 * world)
    for k, v in loaded.items():
        if not is_adapter(k) or "lora_magnitude_vector" in k:  # DoRA's magnitude: the base's norm, as peft's
            assert torch.equal(v, plain["base"][k]), k
    assert_peft_init(method, loaded)
    for r in results:
        assert list(r["loaded"]) == list(loaded) and all(torch.equal(r["loaded"][k], v) for k, v in loaded.items())
        assert_close_to(r["stepped"], plain["stepped"])
        assert r["losses"][0] != r["losses"][-1]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_each_peft_name_maps_to_its_base_models_or_is_an_adapter(kind, method):
    """peft's names (``base_model.model.`` prefix, ``base_layer`` infix, ``modules_to_save`` copies) map
    onto the base model's own state_dict names, each of them taken; the adapters' tensors map to None."""
    from zfunc.weights.peft_keys import base_names

    base_keys = set(build(kind, "meta").state_dict())
    model = peft.get_peft_model(build(kind, "meta"), peft.LoraConfig(r=2, target_modules=TARGETS[kind],
                                                                     modules_to_save=["lm_head"])
                                if method == "lora" else peft_config(kind, method))
    names = base_names(model, model.state_dict())
    assert {k for k, b in names.items() if b is None} == {k for k in names if is_adapter(k)} != set()
    assert {b for b in names.values() if b is not None} == base_keys
    for k, b in names.items():
        if b is not None:
            assert k.startswith("base_model.model.") and (b == k[len("base_model.model."):] or ".base_layer." in k
                                                           or "lm_head." in k), (k, b)
    assert base_names(build(kind, "meta"), base_keys) is None


def load_base_and_adapter(kind: str, method: str, paths: list) -> dict:
    """On each rank: the meta-built peft model's zero3 state read from the base folder and the adapter folder."""
    state = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.adamw(LR))).init(meta_peft(kind, method), weights=paths)
    out = zf.gather_params(state)
    state.close()
    return out


@pytest.mark.parametrize("kind,method,world", [("llama", "lora", 2), pytest.param("gpt2", "ia3", 1, marks=pytest.mark.slow)])
def test_an_adapter_folder_loads_over_its_base(kind, method, world, folder, tmp_path):
    """``weights=[BASE, ADAPTER]``: the folder ``PeftModel.save_pretrained`` writes (adapter weights without
    the adapter's name, modules_to_save copies) read over the base, every tensor bit for bit; an adapter
    tensor the folder lacks is named."""
    base = transformers.AutoModelForCausalLM.from_pretrained(folder(kind))
    model = peft.get_peft_model(base, peft_config(kind, method))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    model.save_pretrained(str(tmp_path / "adapter"))
    want = {k: v.detach().clone() for k, v in model.named_parameters()}
    for got in workers(world).run(load_base_and_adapter, kind, method, [folder(kind), str(tmp_path / "adapter")]):
        assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    holed = rewrite_checkpoint(str(tmp_path / "adapter"), tmp_path / "holed", lambda t: {k: v for k, v in t.items()
                                                                             if ".0.self_attn.v_proj.lora_B" not in k})
    with pytest.raises(ValueError, match=r"2 paths given, but the model is no peft model"):
        zf.train_step(lambda p, x: 0, zf.optim.adamw(LR)).init(build(kind, "meta"), weights=[folder(kind), holed])
    if method == "lora":
        with pytest.raises(ValueError, match=r"files lack: 'base_model\.model\.model\.layers\.0\.self_attn\.v_proj"
                                             r"\.lora_B\.default\.weight \(an adapter tensor, which the adapter folders lack\)'"):
            zf.train_step(lambda p, x: 0, zf.optim.adamw(LR)).init(meta_peft(kind, method), weights=[folder(kind), holed])


def test_a_base_tensor_missing_from_the_folder_is_named(folder, tmp_path):
    """A missing base tensor raises, naming it by the files' name and the peft model's; no strict=False
    hole: the adapters' tensors are never among the missing."""
    holed = rewrite_checkpoint(folder("llama"), tmp_path / "holed", lambda t: {k: v for k, v in t.items()
                                                                        if k != "model.layers.1.self_attn.q_proj.weight"})
    step = zf.train_step(lambda p, x: 0, zf.optim.adamw(LR))
    with pytest.raises(ValueError, match=r"files lack: 'model\.layers\.1\.self_attn\.q_proj\.weight \(in the peft "
                                         r"model: base_model\.model\.model\.layers\.1\.self_attn\.q_proj\.base_layer"
                                         r"\.weight\)'; no tensors the files hold"):
        step.init(meta_peft("llama", "lora"), weights=holed)


def test_only_the_adapters_get_optimizer_state(folder):
    """The frozen base is held once (frozen_bytes); parameters and Adam's two moments are the adapters'."""
    model = meta_peft("llama", "lora")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) * 4
    assert 0 < trainable < frozen
    state = zf.train_step(lambda p, x: 0, zf.optim.adamw(LR)).init(model, weights=folder("llama"))
    report = zf.memory_report(state)
    assert report["param_bytes"] == trainable and report["frozen_bytes"] == frozen
    # Adam's exp_avg and exp_avg_sq over the adapters; beside them only scalars (step counts, hyperparameters)
    moments = sum(t.numel() * 4 for t in optree.tree_leaves(state.opt_state, namespace="zfunc")
                  if isinstance(t, torch.Tensor) and t.numel() > 16)
    assert moments == 2 * trainable and report["optimizer_bytes"] - moments < 256
    state.close()


def test_an_init_zfunc_cannot_repeat_on_meta_is_refused_naming_it(folder):
    """A LoRA init that is a decomposition of the base weights (OLoRA, PiSSA, ...) is refused, naming the
    layer and the init, where it would otherwise be left to transformers' init."""
    model = meta_peft("llama", "lora")
    model.peft_config["default"].init_lora_weights = "olora"
    step = zf.train_step(lambda p, x: 0, zf.optim.adamw(LR))
    with pytest.raises(ValueError, match=r"peft layer .*layers\.0\.self_attn\.q_proj \(Linear\): "
                                         r"init_lora_weights='olora' is computed from the base weights"):
        step.init(model, weights=folder("llama"))



def test_lora_init_is_peft_reset_under_the_same_seed(folder):
    """With the base read from the files nothing else draws: zfunc's adapters are, bit for bit, peft's
    ``reset_lora_parameters`` run over the layers in module order from the same seed (a model that
    get_peft_model builds on the CPU differs only because its constructors draw first)."""
    model, path = meta_peft("llama", "lora"), folder("llama")  # build() seeds: before ours
    torch.manual_seed(11)
    state = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.adamw(LR))).init(model, weights=path)
    got = zf.gather_params(state)
    state.close()
    plain = peft.get_peft_model(build("llama"), peft_config("llama", "lora"))
    torch.manual_seed(11)
    for _, m in plain.named_modules():
        if isinstance(m, peft.tuners.lora.LoraLayer):
            m.reset_lora_parameters("default", True)
    want = {k: v for k, v in plain.named_parameters() if "lora_" in k}
    assert len(want) == 8 and all(torch.equal(got[k], v) for k, v in want.items())
