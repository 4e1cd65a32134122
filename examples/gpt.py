"""A small pre-LN GPT (nanoGPT-like) and a char-level corpus that needs no download.

Shared by examples/train_gpt.py and benchmarks/zero_vs_fsdp.py. The model is an
ordinary nn.Module with its blocks in an nn.ModuleList, so zfunc's default units
(one per block plus a root unit) line up with FSDP's `fully_shard` per block.
"""
import glob
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        assert t <= self.cfg.seq_len, f"sequence of {t} tokens, the model was built for at most {self.cfg.seq_len}"
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Embed(nn.Module):
    """Token plus position embeddings: a pipeline's first layer, whose token table the last
    stage reads again as the LM head (``lm_head``), tied across the two stages."""

    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        for e in (self.tok_emb, self.pos_emb):
            nn.init.normal_(e.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


def lm_head(embed, x):
    return F.linear(x, embed.tok_emb.weight)


def pipeline_layers(cfg):
    """The GPT as a list of pipeline layers (built lazily, stage by stage), the head tied to the embedding."""
    import zfunc as zf

    return [zf.TiedLayerSpec("embed", Embed, cfg), *[zf.LayerSpec(Block, cfg) for _ in range(cfg.n_layers)],
            zf.LayerSpec(nn.LayerNorm, cfg.d_model), zf.TiedLayerSpec("embed", Embed, cfg, forward_fn=lm_head)]


def num_params(model):
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


@torch.no_grad()
def generate(apply_fn, idx, n, seq_len, temperature=0.8, top_k=None, generator=None):
    """Append n sampled tokens to idx (b, t). apply_fn(idx) -> logits, e.g.
    `lambda x: zf.apply(model, params, x)`; the context is cropped to seq_len."""
    for _ in range(n):
        logits = apply_fn(idx[:, -seq_len:])[:, -1, :] / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


# -----------------------------------------------------------------------------
# data: the Python standard library's own source, as bytes (vocab 0..255)

def stdlib_corpus(max_mb=4.0):
    """Sorted *.py files next to os.py, concatenated up to max_mb MB, as a uint8 tensor."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    chunks, size = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
        if size >= max_mb * 1e6:
            break
    data = b"".join(chunks)[: int(max_mb * 1e6)]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split(data, val_fraction=0.1):
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def get_batch(data, batch_size, seq_len, generator):
    """Random windows of data: inputs (b, t) and next-token targets (b, t), int64."""
    ix = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + seq_len] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1 : i + 1 + seq_len] for i in ix.tolist()]).long()
    return x, y


def rank_generator(seed, rank):
    """One sampler per rank: ranks see different batches, reruns see the same ones."""
    return torch.Generator().manual_seed(seed * 1000 + rank)


def encode(text):
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens):
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")
