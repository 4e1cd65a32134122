"""The pipeline tests' model: a small tied-embedding LM as layer specs (a pair activation, a tuple, a
dropped activation), its micro-batches and its engine config; shared by the pipeline tests and by the
tests that run a pipeline through the engine, the DeepSpeed face, the lr schedules and failed updates.
``BUILT`` records each constructor call in this process (which layers a stage built)."""
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf

VOCAB, D, T, LR = 11, 8, 5, 1e-3
BUILT: list = []  # constructor calls in this process: (class name, seed)


class Emb(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        BUILT.append(("Emb", seed))
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(VOCAB, D, generator=g) * 0.5)

    def forward(self, ids):
        return self.weight[ids]


def lm_head(emb: Emb, h):
    return h @ emb.weight.t()


class Lin(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        BUILT.append(("Lin", seed))
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(D, D, generator=g) * 0.3)
        self.bias = nn.Parameter(torch.randn(D, generator=g) * 0.1)

    def forward(self, x):
        return x + torch.tanh(x @ self.weight.t() + self.bias)


class Split(nn.Module):
    """Passes a pair on: a tuple activation."""

    def forward(self, x):
        return x, torch.sigmoid(x)


class Join(nn.Module):
    def forward(self, a, b):
        return a * b


class Dict(nn.Module):
    def forward(self, x):
        return {"h": x}


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class First(nn.Module):
    """Drops the second activation: its gradient is none, and zeros go back for it."""

    def forward(self, a, b):
        return a


def layers(kind: str = "join"):
    """kind "join": the stage after the cut uses both activations of the pair; "first": only one."""
    return [zf.TiedLayerSpec("emb", Emb, 1), zf.LayerSpec(Lin, 2), zf.LayerSpec(Lin, 3), zf.LayerSpec(Split),
            zf.LayerSpec({"join": Join, "first": First}[kind]), zf.LayerSpec(Lin, 4), zf.LayerSpec(Lin, 5),
            zf.TiedLayerSpec("emb", Emb, 1, forward_fn=lm_head)]


def pipe(stages: int, schedule: str = "1f1b", method: str = "uniform", kind: str = "join"):
    return zf.PipelineModule(layers(kind), stages, lm_loss, partition_method=method, schedule=schedule)


def micro_batch(step: int, m: int, replica: int, size: int = 2):
    g = torch.Generator().manual_seed(1000 * step + 10 * m + replica)
    x = torch.randint(0, VOCAB, (size, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def config(micro: int, stage: int = 1, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": micro, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, **extra}
