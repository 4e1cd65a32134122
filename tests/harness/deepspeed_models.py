"""The models, batches and DeepSpeed configs of the ``zfunc.deepspeed.zero`` tests (``GatheredParameters``
and ``Init``): a plain PyTorch model that computes its own loss, and GPT-2 and Llama; a config per
composition name ("stage3+cpu+bf16": the stage, then offload and precision)."""
import tempfile

import torch
import transformers
from torch import nn

from hf import gpt2_config, llama_config

VOCAB = 50
LR = 1e-2
EPS = 1e-4  # Adam's eps above the gradients' rounding, so an update is a smooth function of its gradient


# the Hugging Face models: (class, config) at hf.py's small size with 32 positions
HF = {"gpt2": ("GPT2LMHeadModel", lambda: gpt2_config(n_positions=32)),
      "llama": ("LlamaForCausalLM", lambda: llama_config(max_position_embeddings=32))}


def build(kind: str):
    """``kind``: "gpt2", "llama" or "plain"; seeded 0."""
    torch.manual_seed(0)
    if kind in HF:
        return getattr(transformers, HF[kind][0])(HF[kind][1]())
    return Plain()


class Plain(nn.Module):
    """A plain PyTorch model that computes its own loss from ``input_ids`` and ``labels``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def batch(seed: int) -> dict:
    x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x, "labels": x}


def loss_of(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def config(composition: str, world: int) -> dict:
    stage, *extras = composition.split("+")
    zero = {"stage": int(stage[-1])}
    if "cpu" in extras:
        zero["offload_optimizer"] = {"device": "cpu"}
    if "nvme" in extras:  # parameters and optimizer state in swap files
        folder = tempfile.mkdtemp(prefix="zfunc-gathered-")
        zero["offload_param"] = {"device": "nvme", "nvme_path": folder}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": folder}
    cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
           "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01}}}
    if "bf16" in extras:
        cfg["bf16"] = {"enabled": True}
    return cfg
