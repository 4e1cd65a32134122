"""``zfunc.deepspeed.zero.Init``: the model built on the meta device, each unit made at ``initialize``
by the model's own init (in distribution, as tests/weights/test_hf_meta_init.py proves for meta-built
models: random draws come in another order, so values equal only where the init is deterministic);
pretrained weights read into it train as the plain model does; before ``initialize``,
``GatheredParameters`` gives its parameters their init and keeps what the block writes there."""
import json
import os

import pytest
import torch
import transformers
from torch import nn

import zfunc as zf
import zfunc.deepspeed as deepspeed
from assertions import assert_same_init
from deepspeed_models import EPS, HF, LR, Plain, batch, build, config, loss_of
from workers import workers

def built_normally(kind: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = getattr(transformers, HF[kind][0])(HF[kind][1]())
    return {**{k: v.detach() for k, v in model.named_parameters()}, **dict(model.named_buffers())}


def test_init_builds_on_the_meta_device_and_enabled_false_builds_normally():
    with deepspeed.zero.Init():
        plain = Plain()
        hf = transformers.AutoModelForCausalLM.from_config(HF["llama"][1]())
    assert all(p.is_meta for p in [*plain.parameters(), *hf.parameters()])
    with deepspeed.zero.Init(enabled=False):
        real = build("plain")
    assert not any(p.is_meta for p in real.parameters())
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(real.parameters(), Plain().parameters()))
    with deepspeed.zero.Init(), deepspeed.zero.Init():  # nested, as transformers may nest it
        nested = Plain()
    assert nested.head.weight.is_meta and not torch.empty(1).is_meta


def test_arguments_that_change_nothing_are_accepted_and_the_others_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                                "bf16": {"enabled": True}}))
    accepted = [dict(module=nn.Linear(2, 2), data_parallel_group=None, mem_efficient_linear=False, remote_device="cpu",
                     pin_memory=True, mpu=object(), param_swapper=object(), zero_param_parallel_group=None,
                     sequence_data_parallel_group=None),
                dict(config_dict_or_path=str(path), dtype=torch.bfloat16),
                dict(config={"fp16": {"enabled": True}}, dtype=torch.float16), dict(dtype=torch.float32)]
    for kw in accepted:
        with deepspeed.zero.Init(**kw):
            assert nn.Linear(2, 2).weight.is_meta
    refused = [(dict(zero_quantized_weights=True), "zero_quantized_weights"),
               (dict(config_dict_or_path={"zero_optimization": {"zero_quantized_nontrainable_weights": True}}),
                "zero_quantized_nontrainable_weights"),
               (dict(tensor_overrides=[]), "tensor_overrides"),
               (dict(dtype=torch.bfloat16), "dtype=torch.bfloat16")]
    for kw, named in refused:
        with pytest.raises(ValueError, match=named):
            deepspeed.zero.Init(**kw)


def meta_built_state(kind: str) -> dict:
    """Every parameter and buffer of the engine's state, the model built inside Init."""
    with deepspeed.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(HF[kind][1]())
    torch.manual_seed(7)
    engine, *_ = deepspeed.initialize(model=model, config=config("zero3", zf.dist.world_size()))
    try:
        return {**zf.gather_params(engine.state), **engine.state.buffers}
    finally:
        engine.close()


@pytest.mark.slow  # the fast tier: test_hf_meta_init (meta-built models) and the gathered test at the end
@pytest.mark.parametrize("kind,world", [("gpt2", 2), ("gpt2", 1), ("llama", 1), ("llama", 2)])
def test_initialize_makes_each_unit_by_the_models_own_init(kind, world):
    transformers.logging.set_verbosity_error()
    a, b = built_normally(kind, 0), built_normally(kind, 1)
    for got in workers(world).run(meta_built_state, kind):
        assert_same_init(got, a, b, f"{kind}: ")


def pretrained_run(kind: str, folder: str, steps: int) -> dict:
    """The model built inside Init, its weights read from ``folder``, trained ``steps`` steps."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    with deepspeed.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(HF[kind][1]())
    engine = zf.initialize(model, config("zero3", world), weights=folder)
    deepspeed.zero.register_engine(engine)
    try:
        for i in range(steps):
            engine.train_batch(iter([batch(100 * i + rank)]))
        return zf.gather_params(engine.state)
    finally:
        engine.close()


def plain_from(model: nn.Module, world: int, steps: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    for i in range(steps):
        opt.zero_grad()
        (sum(loss_of(model(**batch(100 * i + r))) for r in range(world)) / world).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def assert_trained_alike(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_a_model_built_inside_init_with_pretrained_weights_trains_as_the_plain_one(kind, tmp_path):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    getattr(transformers, HF[kind][0])(HF[kind][1]()).save_pretrained(tmp_path)
    want = plain_from(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), 2, 3)
    for got in workers(2).run(pretrained_run, kind, str(tmp_path), 3):
        assert_trained_alike(got, want)


def loaded_module_by_module(kind: str, state_dict: dict, steps: int) -> dict:
    """DeepSpeed's way of loading a state_dict into a model built inside Init (GatheredParameters'
    docstring): each module's own parameters gathered, loaded on rank 0, broadcast on exit."""
    rank, world = zf.dist.rank(), zf.dist.world_size()
    with deepspeed.zero.Init():
        model = Plain() if kind == "plain" else transformers.AutoModelForCausalLM.from_config(HF[kind][1]())
    seen = {}

    def load(module: nn.Module, prefix: str = "") -> None:
        own = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
            seen["real"] = seen.get("real", True) and not any(p.is_meta for p in own)
            if rank == 0:
                module._load_from_state_dict(state_dict, prefix, {}, True, [], [], [])
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    with torch.no_grad():
        load(model)
    seen["broadcast"] = all(torch.equal(p, state_dict[n]) for n, p in model.named_parameters())
    engine, *_ = deepspeed.initialize(model=model, config=config("zero3", world))
    try:
        seen["kept_at_init"] = all(torch.equal(v, state_dict[n]) for n, v in zf.gather_params(engine.state).items())
        for i in range(steps):
            engine.train_batch(iter([batch(100 * i + rank)]))
        seen["params"] = zf.gather_params(engine.state)
        return seen
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["plain", pytest.param("gpt2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_state_dict_loaded_inside_gathered_parameters_is_what_initialize_starts_from(kind, world):
    """Before initialize: GatheredParameters gives each meta parameter real storage, rank 0 loads the
    module's weights, the exit broadcasts them; initialize keeps them (it initializes only what is
    still on the meta device) and training equals plain PyTorch's from that state_dict."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(3)
    source = build(kind) if kind == "plain" else getattr(transformers, HF[kind][0])(HF[kind][1]())
    state_dict = {k: v.detach().clone() for k, v in source.state_dict().items()}
    want = plain_from(source, world, 2)
    for got in workers(world).run(loaded_module_by_module, kind, state_dict, 2):
        assert got["real"] and got["broadcast"] and got["kept_at_init"], {k: v for k, v in got.items() if k != "params"}
        assert_trained_alike(got["params"], want)


def test_gathered_parameters_before_initialize_reads_the_models_init_and_discards_without_modifier():
    """A meta parameter gathered before initialize holds its module's init (transformers' for a Hugging
    Face model); modifier_rank=None puts back what it held at the block's start."""
    transformers.logging.set_verbosity_error()
    with deepspeed.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(HF["gpt2"][1]())
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(params.values()):
        got = {k: p.detach().clone() for k, p in params.items()}
    a, b = built_normally("gpt2", 0), built_normally("gpt2", 1)
    assert_same_init(got, {k: a[k] for k in got}, {k: b[k] for k in got}, "gpt2 gathered before initialize: ")
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.is_meta  # tie kept
    with deepspeed.zero.Init():
        fresh = Plain()
    with deepspeed.zero.GatheredParameters(fresh.head.bias), torch.no_grad():
        start = fresh.head.bias.clone()
        fresh.head.bias.fill_(3.0)
    assert torch.equal(fresh.head.bias, start) and not start.isnan().any()
    # now it holds data: a block leaves it alone, as DeepSpeed leaves a parameter that is not ZeRO's
    with deepspeed.zero.GatheredParameters(fresh.head.bias), torch.no_grad():
        fresh.head.bias.fill_(4.0)
    assert torch.equal(fresh.head.bias, torch.full_like(start, 4.0)) and fresh.head.weight.is_meta


@pytest.mark.parametrize("kind", ["plain", "gpt2", "llama"])
def test_initialize_keeps_what_a_block_wrote_into_some_parameters_of_a_unit(kind):
    """Values written before initialize into some parameters (GPT-2's c_proj, which its block's
    ``_init_weights`` also writes; a Linear whose bias is still on the meta device, which its
    ``reset_parameters()`` would write) are what the state starts from; the rest of their units gets
    the model's init."""
    transformers.logging.set_verbosity_error()
    with deepspeed.zero.Init():
        model = Plain() if kind == "plain" else transformers.AutoModelForCausalLM.from_config(HF[kind][1]())
    names = {"gpt2": ["transformer.h.0.attn.c_proj.weight", "transformer.h.1.mlp.c_fc.bias"],
             "llama": ["model.layers.0.self_attn.o_proj.weight", "model.norm.weight"],
             "plain": ["blocks.1.0.weight", "head.bias"]}[kind]
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters([params[n] for n in names], modifier_rank=0), torch.no_grad():
        for i, n in enumerate(names):
            params[n].fill_(0.125 * (i + 1))
    state = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1))).init(model)
    got = zf.gather_params(state)
    for i, n in enumerate(names):
        assert torch.equal(got[n], torch.full_like(got[n], 0.125 * (i + 1))), n
    rest = [k for k in got if k not in names]
    if kind == "plain":  # nn's own init: the other tensor of each module drawn, not left unset
        assert all(got[k].isfinite().all() and got[k].std() > 0 for k in rest)
        return
    a, b = built_normally(kind, 0), built_normally(kind, 1)
    assert_same_init({k: got[k] for k in rest}, {k: a[k] for k in rest}, {k: b[k] for k in rest}, f"{kind}: ")


def test_a_spill_renamed_for_the_wrapping_model_is_untouched_when_the_copy_fails(monkeypatch):
    """A model built under a ZeRO-3 Init, written through GatheredParameters and wrapped by another
    module: initialize renames its spill to the wrapper's names; a failure while copying (a full disk)
    leaves the spill as it was and removes the copy, and a later initialize loads it."""
    from zfunc.deepspeed import zero

    cfg = config("zero3", 1)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        inner = Plain()
    want = {}
    for module in inner.modules():
        own = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(own, modifier_rank=0), torch.no_grad():
            for p in own:
                p.fill_(0.25)
    for name, p in inner.named_parameters():
        want[f"inner.{name}"] = torch.full(tuple(p.ds_shape), 0.25)

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return self.inner(**kw)

    model = Wrapper()
    spill = zero.spilled(model)
    before = sorted(os.listdir(spill.folder))
    made = []
    real_init = zero.Spill.__init__

    def tracked(self):
        real_init(self)
        made.append(self.folder)

    def full(self, values):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(zero.Spill, "__init__", tracked)
    monkeypatch.setattr(zero.Spill, "write", full)
    with pytest.raises(OSError, match="No space"):
        deepspeed.initialize(model=model, config=cfg)
    monkeypatch.undo()
    assert zero.spilled(model) is spill and sorted(os.listdir(spill.folder)) == before
    assert made and not any(os.path.exists(f) for f in made)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    got = zf.gather_params(engine.state)
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    engine.close()
