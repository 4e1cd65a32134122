"""Tiny Hugging Face models built from configs (no download), for every test that trains, saves or
reads one. One config function per family at the suite's small size (``overrides`` for the tests that
need another vocabulary, width, depth or length), ``build(kind)`` for the families the pretrained-weights
tests write and read back, the token batches they train on, their learning rate, a sharded run of
them (``train_on_rank``), and a rewriter of a saved checkpoint's tensors (to damage or rename them)."""
import os

import safetensors.torch as safetensors
import torch
import transformers
from torch import nn

LR = 1e-3
# the decoder families' small shape: 2 layers of width 16, one key-value head, 16 positions
SMALL = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=16)
GPT2_SMALL = dict(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama_config(**overrides) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**(SMALL | overrides))


def qwen2_config(**overrides) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(**(SMALL | overrides))


def gpt2_config(**overrides) -> transformers.GPT2Config:
    """No dropout, so a step is a function of the weights and the batch."""
    return transformers.GPT2Config(**(GPT2_SMALL | overrides))


def config(kind: str):
    """The config ``build(kind)`` uses: Llama and GPT-2 small, Qwen2 tied, two MoE families, T5."""
    t = transformers
    return {
        "llama": lambda: llama_config(),
        "qwen2": lambda: qwen2_config(tie_word_embeddings=True),
        "mixtral": lambda: t.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                              head_dim=8),
        "gpt2": lambda: gpt2_config(),
        "t5": lambda: t.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                                 num_heads=2, dropout_rate=0.0, decoder_start_token_id=0),
    }[kind]()


def build(kind: str, device: str = "cpu", seed: int = 0) -> nn.Module:
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM",
           "gpt2": "GPT2LMHeadModel", "t5": "T5ForConditionalGeneration"}[kind]
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, cls)(config(kind))
    model.config.use_cache = False
    return model


def tokens(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (size, 8), generator=torch.Generator().manual_seed(seed))


def train_on_rank(model: nn.Module, loss_fn, steps: int, per_rank: int) -> dict:
    """``zero3(offload_cpu(recompute(train_step(loss_fn, adamw))))`` trained ``steps`` steps on this
    rank's ``per_rank`` rows of each step's ``tokens``: the gathered parameters and the losses."""
    import zfunc as zf

    rank, world = zf.dist.rank(), zf.dist.world_size()
    step = zf.zero3(zf.offload_cpu(zf.recompute(zf.train_step(loss_fn, zf.optim.adamw(LR)))))
    state = step.init(model)
    losses = []
    for i in range(steps):
        x = tokens(per_rank * world, seed=i)[rank * per_rank : (rank + 1) * per_rank]
        state, metrics = step(state, x)
        losses.append(metrics["loss"].item())
    return {"params": zf.gather_params(state), "losses": losses}


def rewrite_checkpoint(src: str, dst, change) -> str:
    """A one-file copy of checkpoint ``src`` at ``dst/model.safetensors``, its tensors passed through ``change``."""
    from zfunc.weights.safetensors_reader import Reader, tensors_of

    with Reader() as r:
        tensors = {k: r.read(i) for k, i in tensors_of(src).items()}
    os.makedirs(dst, exist_ok=True)
    safetensors.save_file(change(tensors), os.path.join(dst, "model.safetensors"))
    return str(dst)
