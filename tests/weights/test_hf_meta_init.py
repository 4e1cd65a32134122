"""A Hugging Face model built on the meta device and initialized by zfunc holds what the model
built normally holds (transformers' own ``post_init``), and with ``weights=..., strict=False``
what ``from_pretrained`` gives: parameters and buffers, family by family.

Random init cannot be compared bit for bit (the draws come in another order), so a tensor is
compared as follows: where the model built with two seeds agrees (buffers, norms' ones, zero
biases, embedding scales, a padding row) zfunc's value equals it exactly; elsewhere its mean and
standard deviation match within sampling tolerance (the test fails on nn.Linear's default init,
std 0.10 where transformers gives 0.02)."""
import os
import warnings

import pytest
import torch

import zfunc as zf
from assertions import assert_same_init
from zfunc.weights.pretrained import WeightsMismatch

import transformers  # noqa: E402  the [test] extra installs it
import safetensors.torch as safetensors  # noqa: E402

t = transformers
S = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    "llama": ("LlamaForCausalLM", lambda: t.LlamaConfig(**S)),
    "llama-tied-pad": ("LlamaForCausalLM", lambda: t.LlamaConfig(**S, tie_word_embeddings=True, pad_token_id=3)),
    "gemma": ("GemmaForCausalLM", lambda: t.GemmaConfig(**S, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", lambda: t.Gemma2Config(**S, head_dim=8)),
    "gemma3_text": ("Gemma3ForCausalLM", lambda: t.Gemma3TextConfig(**S, head_dim=8)),
    "qwen2": ("Qwen2ForCausalLM", lambda: t.Qwen2Config(**S)),
    "qwen3": ("Qwen3ForCausalLM", lambda: t.Qwen3Config(**S, head_dim=8)),
    "mistral": ("MistralForCausalLM", lambda: t.MistralConfig(**S)),
    "phi3": ("Phi3ForCausalLM", lambda: t.Phi3Config(**S, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt2": ("GPT2LMHeadModel", lambda: t.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                     bos_token_id=0, eos_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", lambda: t.GPTNeoXConfig(**S)),
    "opt": ("OPTForCausalLM", lambda: t.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                  num_attention_heads=4, max_position_embeddings=64,
                                                  word_embed_proj_dim=32)),
    "falcon": ("FalconForCausalLM", lambda: t.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4)),
    "stablelm": ("StableLmForCausalLM", lambda: t.StableLmConfig(**S)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: t.Qwen3MoeConfig(**S, **MOE, head_dim=8, num_experts=4,
                                                                  moe_intermediate_size=16)),
    "mixtral": ("MixtralForCausalLM", lambda: t.MixtralConfig(**S, **MOE, num_local_experts=4)),
    "t5": ("T5ForConditionalGeneration", lambda: t.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                            num_heads=4, decoder_start_token_id=0)),
    "bert": ("BertForMaskedLM", lambda: t.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     max_position_embeddings=64)),
    "roberta": ("RobertaForMaskedLM", lambda: t.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=4, intermediate_size=64,
                                                              max_position_embeddings=66)),
}
FAST = ["llama-tied-pad", "gemma2", "gpt2", "qwen3_moe"]  # the rest: -m slow
families = [pytest.param(f, marks=() if f in FAST else pytest.mark.slow) for f in FAMILIES]


def quiet():
    t.logging.set_verbosity_error()
    return warnings.catch_warnings()


def built(cls: str, config, seed: int) -> dict:
    """Every parameter and buffer of the model built normally (its ``post_init``)."""
    torch.manual_seed(seed)
    model = getattr(t, cls)(config())
    return {**{k: v.detach() for k, v in model.named_parameters()}, **dict(model.named_buffers())}


def zfunc_init(cls: str, config, seed: int = 7, **kw) -> dict:
    """Every parameter and buffer of the state zfunc makes from the model built on the meta device."""
    with torch.device("meta"):
        model = getattr(t, cls)(config())
    torch.manual_seed(seed)
    state = zf.zero3(zf.train_step(lambda p, x: 0, zf.optim.sgd(0.1))).init(model, **kw)
    return {**zf.gather_params(state), **state.buffers}


@pytest.mark.parametrize("family", families)
def test_meta_init_holds_what_the_model_built_normally_holds(family):
    cls, config = FAMILIES[family]
    with quiet():
        assert_same_init(zfunc_init(cls, config), built(cls, config, 0), built(cls, config, 1), f"{family}: ")


def _dropped(keys: list[str]) -> set[str]:
    """Some of a checkpoint's tensors: every third, a norm and a bias among them where there are; never
    one of several that transformers fuses into one (experts: read whole or not at all)."""
    plain = sorted(k for k in keys if ".experts." not in k)
    out = set(plain[::3])
    out |= {next((k for k in plain if "norm" in k), plain[0]), next((k for k in plain if k.endswith("bias")), plain[0])}
    return out


@pytest.mark.parametrize("family", families)
def test_strict_false_holds_what_from_pretrained_gives(family, tmp_path):
    """A folder that lacks some tensors: zfunc reads the rest and initializes those as
    ``from_pretrained`` does (transformers' ``_init_weights``), buffers computed as it computes them."""
    cls, config = FAMILIES[family]
    with quiet():
        torch.manual_seed(0)
        getattr(t, cls)(config()).save_pretrained(tmp_path / "full")
        full = safetensors.load_file(tmp_path / "full" / "model.safetensors")
        drop = _dropped(list(full))
        os.makedirs(tmp_path / "part")
        safetensors.save_file({k: v for k, v in full.items() if k not in drop}, tmp_path / "part" / "model.safetensors")
        (tmp_path / "part" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
        ref = getattr(t, cls).from_pretrained(tmp_path / "part")
        want = {**{k: v.detach() for k, v in ref.named_parameters()}, **dict(ref.named_buffers())}
        with pytest.warns(WeightsMismatch, match=rf"{len(drop)} missing") as caught:
            got = zfunc_init(cls, config, weights=tmp_path / "part", strict=False)
        other = built(cls, config, 1)
    assert sorted(caught[0].message.incompatible.missing_keys)  # named, as load_state_dict returns them
    for k, v in want.items():
        if k in full and k not in drop:  # read from the files
            assert torch.equal(got[k], v), f"{family}: {k} not read"
    missing = {k for k in want if k not in full or k in drop}
    assert missing
    assert_same_init({k: got[k] for k in missing}, {k: want[k] for k in missing}, {k: other[k] for k in missing},
                     f"{family} (missing): ")


# ------------------------------------------------- every family transformers ships

SMALL = dict(vocab_size=64, hidden_size=32, n_embd=32, d_model=32, intermediate_size=64, ffn_dim=64, n_inner=64,
             num_hidden_layers=2, n_layer=2, num_layers=2, num_attention_heads=4, n_head=4, num_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, n_positions=64, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Families whose constructor sets a parameter that neither transformers' _init_weights nor a
# reset_parameters() can compute again: zfunc names it (from_pretrained leaves it as empty memory).
UNINITIALIZABLE = {"apertus": "XIELUActivation", "apertus1p5_text": "XIELUActivation"}


def small_config(kind: str):
    """``kind``'s default config with every size it has made small, or None where that config does
    not build (a family that needs sizes set together)."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(kind)
        sizes = {k: v for k, v in SMALL.items() if hasattr(default, k) and not callable(getattr(default, k))}
        return AutoConfig.for_model(kind, **sizes)
    except Exception:
        return None


@pytest.mark.slow
def test_every_causal_lm_family_transformers_ships():
    """Each causal LM family of transformers that builds from a small config: zfunc's meta-device
    init holds what the model built normally holds. Most of them (over 100) must build."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    checked, failed = [], {}
    with quiet():
        for kind, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
            cls = cls[0] if isinstance(cls, (list, tuple)) else cls
            config = small_config(kind)
            if config is None:
                continue
            try:
                with torch.device("meta"):
                    size = sum(p.numel() for p in getattr(t, cls)(config).parameters())
            except Exception:
                continue  # this generic small config does not suit the family
            if size > 3_000_000:
                continue
            try:
                assert_same_init(zfunc_init(cls, lambda: config), built(cls, lambda: config, 0),
                                 built(cls, lambda: config, 1), f"{kind}: ")
                checked.append(kind)
            except Exception as e:
                failed[kind] = f"{type(e).__name__}: {e}"
    unexplained = {k: v for k, v in failed.items() if UNINITIALIZABLE.get(k, "\0") not in v}
    assert not unexplained, unexplained
    assert len(checked) >= 100, checked
