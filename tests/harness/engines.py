"""What the engine tests (zf.initialize) share: a DeepSpeed config for the suite's GPT, each rank's
micro-batches of it, its loss, and a Hugging Face GPT-2 with its batches and its plain PyTorch
reference (AdamW, the micro-batches' mean loss, clipping)."""
import torch
import transformers

from cases import LR
from models import batch, local, loss

GLOBAL_MICRO = 6  # examples per micro-batch over all ranks: splits over W = 1, 2, 3


def engine_config(stage: int, gas: int = 2, **extra) -> dict:
    return {"train_batch_size": GLOBAL_MICRO * gas, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, **extra}


def micro_batches(name, model, rank, world, gas, start=0):
    """This rank's micro-batches, step after step: global micro-batch k is batch(name, k)."""
    k = start * gas
    while True:
        yield local(batch(name, model, k, GLOBAL_MICRO), rank, world)
        k += 1


def gpt_loss(model, b):
    return loss("gpt", model(b[0]), b[1])


def hf_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_batch(k: int) -> dict:
    """Global micro-batch k: 4 sequences of 12 tokens (labels = inputs; the model shifts them)."""
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randint(0, 64, (4, 12), generator=g)
    return {"input_ids": x, "labels": x}


def hf_reference(steps: int, gas: int, clip: float) -> dict:
    """Plain PyTorch: AdamW with its defaults, each step's micro-batches' mean loss, clip_grad_norm_."""
    model = hf_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, k = [], 0
    for _ in range(steps):
        opt.zero_grad()
        total = sum(model(**hf_batch(k + j)).loss for j in range(gas)) / gas
        k += gas
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total.item())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses}
