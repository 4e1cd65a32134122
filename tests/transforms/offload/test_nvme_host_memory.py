"""zf.offload_nvme's host memory is its read pool, the update's staging sets and a unit or two,
whatever the model's size: the peak RSS of a fresh process that initializes and trains a GPT
whose fp32 model states are several times that bound stays within it (docs/offload.md has the
figures), and under offload_cpu's, which keeps the whole optimizer state in RAM."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.testing import memory
from workers import fresh_workers

VOCAB, WIDTH, LAYERS, SEQ = 2048, 256, 24, 16
BUFFER = 2**18  # elements: every unit (the root 1.05M, a block 0.53M) is larger, as Llama-3-8B's at W = 1 with 1e8
PARAM, GRAD, STATE = 2, 2, 12  # bytes per element: bf16 parameters and gradients; fp32 master and Adam moments
SLACK = 8 << 20  # activations, autograd's and the allocators' small blocks, Python objects


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def host_memory_run(offload: str, path: str) -> dict:
    """In a fresh process: a warm-up on a small model (every code path loaded once), then the peak
    RSS above the RSS after it while a GPT built on the meta device is initialized and trained 2
    steps at W = 1 under zero3(offload(mixed_precision(train_step), bf16))."""
    running = [GPT(VOCAB, WIDTH, 1)]

    def loss_fn(p, b):
        return F.cross_entropy(zf.apply(running[0], p, b[0]).flatten(0, 1), b[1].flatten())

    step = zf.mixed_precision(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), torch.bfloat16)
    # sub_group_size is DeepSpeed's default, 1e9: the update's staging sets still hold at most buffer_size
    step = zf.offload_nvme(step, path, buffer_size=BUFFER) if offload == "nvme" else zf.offload_cpu(step)
    step = zf.zero3(step)
    tokens = torch.randint(VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    with step.init(running[0]) as warm:
        step(warm, batch)
    del warm
    with torch.device("meta"):
        running[0] = GPT(VOCAB, WIDTH, LAYERS)
    zf.buffers.trim()
    memory.reset_peak()
    before = memory.rss()
    with step.init(running[0]) as state:
        for _ in range(2):
            state, metrics = step(state, batch)
        peak = memory.peak() - before
        return {"peak": peak, "swap_buffer_bytes": zf.memory_report(state)["swap_buffer_bytes"],
                "units": [(u.name, u.trainable.padded) for u in state.params.spec.model.units],
                "nvme": metrics.get("nvme")}


@pytest.mark.slow
def test_host_memory_is_the_pool_staging_and_two_units_not_the_model():
    with tempfile.TemporaryDirectory() as path, fresh_workers(1) as group:
        [nvme] = group.run(host_memory_run, "nvme", path)  # first, in the fresh process
        [cpu] = group.run(host_memory_run, "cpu", path)  # after it: what nvme freed can only lower this one
    sizes = dict(nvme["units"])
    params, largest = sum(sizes.values()), max(sizes.values())
    assert min(sizes.values()) > BUFFER and nvme["nvme"]["pool_oversize"] >= 2 * len(sizes)  # read in every step
    pool = 5 * BUFFER * PARAM  # buffer_count buffers of buffer_size bf16 elements
    staging = 3 * BUFFER * (PARAM + GRAD + STATE)  # three sets of buffer_size elements of every tensor
    unit = largest * (PARAM + GRAD + STATE)
    bound = pool + staging + 2 * unit + SLACK
    model_states = params * (4 + 4 + 4 + 4)  # fp32 parameters (master), gradients, two Adam moments
    print(f"\npeak RSS above baseline: offload_nvme {nvme['peak'] / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB: "
          f"pool {pool / 2**20:.1f}, staging {staging / 2**20:.1f}, 2 units {2 * unit / 2**20:.1f}, slack "
          f"{SLACK / 2**20:.0f}), offload_cpu {cpu['peak'] / 2**20:.1f} MiB; fp32 model states "
          f"{model_states / 2**20:.1f} MiB ({params / 1e6:.2f}M parameters)")
    assert nvme["swap_buffer_bytes"] <= pool + staging
    assert nvme["peak"] <= bound, (nvme["peak"] / 2**20, bound / 2**20)
    assert bound < model_states / 3, (bound / 2**20, model_states / 2**20)
    assert nvme["peak"] < cpu["peak"] / 2, (nvme["peak"] / 2**20, cpu["peak"] / 2**20)
