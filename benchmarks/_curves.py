"""The two small models the loss-curve benchmarks train (delayed_update.py, bf16_state.py): the
example GPT and a tiny Hugging Face Llama built from a config."""
import torch

import zfunc as zf
from gpt import GPT, GPTConfig  # examples/ on sys.path, as the callers put it


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def models(seq: int) -> dict:
    """name -> (build, its logits from (model, params, x), compute dtype or None for fp32)."""
    return {
        "gpt": (lambda: GPT(GPTConfig(vocab_size=256, seq_len=seq, d_model=128, n_layers=4, n_heads=4)),
                lambda m, p, x: zf.apply(m, p, x), None),
        "llama": (tiny_llama, lambda m, p, x: zf.apply(m, p, x).logits, torch.bfloat16),
    }
