"""Small models covering the edge cases of docs/testing.md, and batches for them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly-zero true gradient (softmax is shift
        # invariant), so its gradient is rounding noise that Adam amplifies to +-lr.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TiedGPT(nn.Module):
    """GPT-like, with the LM head tied to the token embedding."""

    def __init__(self, vocab: int = 13, d: int = 8, layers: int = 2, seq: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Scale(nn.Module):
    """A unit of one element: smaller than any world size above 1."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor([1.1]))

    def forward(self, x):
        return x * self.s


class OddMLP(nn.Module):
    """Widths whose parameter counts are not divisible by 2 or 3, and a 1-element unit."""

    def __init__(self, widths=(5, 7, 3)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.layers.insert(1, Scale())

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class FrozenBN(nn.Module):
    """A frozen parameter, a fixed buffer and BatchNorm running statistics."""

    def __init__(self, d: int = 6):
        super().__init__()
        # Biases in front of BatchNorm have an exactly-zero true gradient (BN removes
        # constants); rounding noise there is amplified by Adam, so leave them out.
        self.inp = nn.Linear(4, d, bias=False)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d, bias=False), nn.BatchNorm1d(d), nn.ReLU()) for _ in range(2)
        )
        self.blocks[0][0].weight.requires_grad_(False)
        self.out = nn.Linear(d, 2)
        self.register_buffer("shift", torch.linspace(-1, 1, d))

    def forward(self, x):
        x = self.inp(x) + self.shift
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class NoList(nn.Module):
    """No ModuleList at all: everything lands in the root unit."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 9), nn.Tanh(), nn.Linear(9, 2))

    def forward(self, x):
        return self.net(x)


class DeepMLP(nn.Module):
    """Residual MLP of drawn width and depth, for property-based tests."""

    def __init__(self, d_in: int, width: int, depth: int, d_out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth))
        self.out = nn.Linear(width, d_out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.out(x)


class CrossTied(nn.Module):
    """One weight shared by two different units, and a unit nested inside another."""

    def __init__(self, d: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3))
        self.blocks[2][0].weight = self.blocks[0][0].weight
        self.inner = nn.Sequential(nn.Linear(d, d), nn.ModuleList([nn.Linear(d, 2)]))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.inner[1][0](torch.tanh(self.inner[0](x)))


class External(nn.Module):
    """Weights read outside their unit's forward: a gate weight in the root's forward,
    a norm weight of the last block as a custom head, the embedding as a functional
    LM head (``F.linear(h, self.emb[0].weight)``)."""

    def __init__(self, vocab: int = 11, d: int = 6, depth: int = 2):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(vocab, d)])
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(depth))
        self.gate = nn.ModuleList([nn.Linear(d, 1)])

    def forward(self, idx):
        h = self.emb[0](idx)
        for block in self.blocks:
            h = h + block(h) * torch.tanh(self.gate[0].weight.sum())
        h = h * self.blocks[-1][0].weight
        return F.linear(h, self.emb[0].weight)


class CkptBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + checkpoint(self._mlp, self.ln(x), use_reentrant=False)

    def _mlp(self, h):
        return self.fc2(torch.tanh(self.fc1(h)))


class Checkpointed(nn.Module):
    """Activation checkpointing in a block's forward, and around whole blocks in the model's."""

    def __init__(self, d: int = 6, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(CkptBlock(d) for _ in range(depth))
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i % 2 == 0 else block(x)
        return self.out(x)


class Skipping(DeepMLP):
    """A residual MLP whose forward skips block ``self.skip`` (control flow, same on every rank)."""

    def __init__(self, depth: int = 3):
        super().__init__(4, 6, depth, 2)
        self.skip = None

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = x + torch.tanh(block(x))
        return self.out(x)


class Reusing(nn.Module):
    """Two blocks applied alternately three times each (weight sharing across depth, as in
    ALBERT or a looped transformer): each unit is materialized three times a forward."""

    def __init__(self, d: int = 6, repeats: int = 3):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(2))
        self.out = nn.Linear(d, 2)
        self.repeats = repeats

    def forward(self, x):
        x = self.inp(x)
        for _ in range(self.repeats):
            for block in self.blocks:
                x = x + torch.tanh(block(x))
        return self.out(x)


class Sometimes(nn.Module):
    """A parameter some batches do not read: ``extra`` (in the root unit, which every batch runs)
    acts only on the examples whose last input is 1, and runs only if there are any, so a step, a
    rank or a micro-batch without one gives it no gradient (torch leaves its ``.grad`` None)."""

    def __init__(self, d_in: int = 4, d: int = 6, d_out: int = 2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.extra = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(2))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.inp(x)
        flag = x[:, -1:]
        if bool(flag.any()):
            h = h + flag * torch.tanh(self.extra(h))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


class SeededNet(nn.Module):
    """A 6-16-16-16-2 tanh MLP in three units that seeds itself: the same weights wherever it is built
    (the offload plan, host update and delayed update tests)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


MODELS = {"sometimes": Sometimes, "reusing": Reusing, "gpt": TiedGPT, "external": External, "checkpointed": Checkpointed, "skipping": Skipping, "odd_mlp": OddMLP, "frozen_bn": FrozenBN, "no_list": NoList, "deep_mlp": DeepMLP, "cross_tied": CrossTied}


# the deep MLP's shape where a test trains it (lower precision, accumulation, offload), and the
# keyword arguments of the models a test runs by name
DEEP_MLP = {"d_in": 5, "width": 16, "depth": 3, "d_out": 3}
MODEL_KW = {"deep_mlp": DEEP_MLP, "odd_mlp": {}, "gpt": {}, "checkpointed": {}, "external": {}}


def build(name: str, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name](**kw)


def batch(name: str, model: nn.Module, step: int, size: int, seed: int = 0, device: str = "cpu"):
    """The global batch of ``size`` examples for ``step``: (inputs, targets), on ``device`` (drawn on
    the CPU, so every device sees the same numbers)."""
    return tuple(t.to(device) for t in _draw(name, model, step, size, seed))


def _draw(name: str, model: nn.Module, step: int, size: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if name == "gpt":
        vocab, seq = model.tok.num_embeddings, model.pos.shape[0]
        tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    if name == "external":
        tokens = torch.randint(0, model.emb[0].num_embeddings, (size, 5), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    d_in = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    d_out = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features
    x, y = torch.randn(size, d_in, generator=g), torch.randn(size, d_out, generator=g)
    if name == "sometimes":  # only the first example of steps after the first reads ``extra``
        x[:, -1] = 0.0
        x[0, -1] = float(step > 0)
    return x, y


def loss(name: str, logits, targets):
    if name in ("gpt", "external"):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    # in fp32, as autocast does: torch 2.11's mse_loss backward rejects bf16 logits with fp32 targets
    return F.mse_loss(logits.float(), targets)


def local(b, rank: int, world: int):
    """This rank's slice of a global batch."""
    n = b[0].shape[0] // world
    return tuple(t[rank * n : (rank + 1) * n] for t in b)


# ---------------------------------------------------------------------------
# Every kind of leaf in every unit position (offload_nvme's frozen shards, tests/transforms/offload/test_nvme_leaf_kinds.py).

LEAF_KINDS = ("tied", "frozen", "scalar", "buffer")


class LeafPart(nn.Module):
    """``d -> d``: a linear map and the leaves in ``kinds``: ``tied`` (a second map sharing its
    weight), ``frozen`` (a table without gradient), ``scalar`` (a one-element parameter),
    ``buffer`` (a float buffer); ``all_frozen``: the linear map frozen too (no trainable leaf)."""

    def __init__(self, d: int, kinds=(), all_frozen: bool = False):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.lin.requires_grad_(not all_frozen)
        self.twin = None
        if "tied" in kinds:
            self.twin = nn.Linear(d, d, bias=False)
            self.twin.weight = self.lin.weight
        if "frozen" in kinds:
            self.table = nn.Parameter(torch.randn(d) * 0.3, requires_grad=False)
        if "scalar" in kinds:
            self.s = nn.Parameter(torch.tensor([0.9]))
        if "buffer" in kinds:
            self.register_buffer("shift", torch.linspace(-0.5, 0.5, d))

    def forward(self, x):
        h = self.lin(x)
        if self.twin is not None:
            h = h + 0.5 * self.twin(torch.tanh(x))
        if hasattr(self, "table"):
            h = h * (1 + self.table)
        if hasattr(self, "s"):
            h = h * self.s
        if hasattr(self, "shift"):
            h = h + self.shift
        return x + torch.tanh(h)


class Nest(nn.Module):
    """A ModuleList child holding a ModuleList of its own: a unit nested inside another."""

    def __init__(self, d: int, kinds=(), all_frozen: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inner = nn.ModuleList([LeafPart(d, kinds, all_frozen)])

    def forward(self, x):
        return self.inner[0](self.norm(x))


class LeafKindsLM(nn.Module):
    """A small transformer LM whose units hold the leaf kinds asked for, in each position.

    The root: the token embedding (tied to the head with ``tied``), a positional table
    (frozen with ``frozen``), a one-element gain (``scalar``), a float buffer added to the
    embeddings (``buffer``). The ModuleList ``blocks``: a transformer ``Block``, the
    one-element unit ``Scale``, a ``LeafPart`` with the ``child`` kinds and a ``Nest`` whose
    own ModuleList holds a ``LeafPart`` with the ``nested`` kinds. ``all_frozen``: positions
    (``"child"``, ``"nested"``) whose part has no trainable leaf at all.
    """

    def __init__(self, root=LEAF_KINDS, child=LEAF_KINDS, nested=LEAF_KINDS, all_frozen=(), vocab: int = 11,
                 d: int = 8, seq: int = 5):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1, requires_grad="frozen" not in root)
        if "scalar" in root:
            self.gain = nn.Parameter(torch.tensor([1.2]))
        if "buffer" in root:
            self.register_buffer("offset", torch.linspace(-0.2, 0.2, d))
        self.blocks = nn.ModuleList([Block(d), Scale(), LeafPart(d, child, "child" in all_frozen),
                                     Nest(d, nested, "nested" in all_frozen)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if "tied" in root:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        if hasattr(self, "gain"):
            x = x * self.gain
        if hasattr(self, "offset"):
            x = x + self.offset
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
