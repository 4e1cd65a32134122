"""Hugging Face ``transformers`` models built from a config (no download), trained with
activation checkpointing under every ZeRO stage, equal plain PyTorch (AdamW defaults).

GPT-2 ties its LM head to the token embedding and reads ``wte.weight`` outside the
embedding's forward; Llama adds rotary embeddings, RMSNorm and grouped-query attention."""
import pytest
import torch

import zfunc as zf
from test_zero_equivalence import assert_close_to
from workers import workers

transformers = pytest.importorskip("transformers")  # the [test] extra installs it
STEPS = 3


def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def tokens(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, 50, (size, 8), generator=torch.Generator().manual_seed(step))


def reference(kind: str, batch_size: int) -> dict:
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(STEPS):
        x = tokens(i, batch_size)
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run(kind: str, stage: int, per_rank: int) -> dict:
    rank, world = zf.dist.rank(), zf.dist.world_size()
    model = build(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    def loss_fn(params, x):
        return zf.apply(model, params, input_ids=x, labels=x).loss

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    step = {0: step, 1: zf.zero1(step), 2: zf.zero2(step), 3: zf.zero3(step)}[stage]
    state = step.init(model)
    for i in range(STEPS):
        state, _ = step(state, tokens(i, per_rank * world)[rank * per_rank : (rank + 1) * per_rank])
    return zf.gather_params(state)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_matches_pytorch(kind, world):
    expected = reference(kind, 2 * world)
    for stage in (0, 1, 2, 3):
        for got in workers(world).run(run, kind, stage, 2):
            assert_close_to(got, expected)
