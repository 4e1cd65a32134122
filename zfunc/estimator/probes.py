"""This machine's rates, measured: a matrix product's FLOP/s, a copy's memory bytes/s, and a process
group's all-reduce fitted to the alpha-beta model (two sizes, so latency and bandwidth separate)."""
from __future__ import annotations

import time

import torch

from .. import dist
from .cluster import Cluster, Link


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up: allocation, the first call's dispatch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def compute_rate(n: int = 1024, dtype: torch.dtype = torch.float32, device=None, repeats: int = 3) -> float:
    """FLOP/s of an ``n`` x ``n`` matrix product in ``dtype`` on ``device`` (default: the accelerator,
    else the CPU with this process's threads)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2.0 * n ** 3 / _best_of(lambda: torch.mm(a, b), repeats)


def memory_rate(numel: int = 1 << 24, device=None, repeats: int = 3) -> float:
    """Bytes/s a copy of ``numel`` fp32 elements streams (read and written)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _best_of(lambda: dst.copy_(src), repeats)


def link_rate(group=None, small: int = 1 << 10, large: int = 1 << 22, repeats: int = 3) -> Link:
    """``group``'s all-reduce (every rank of it calls this) fitted to the ring's alpha-beta model
    from a ``small`` and a ``large`` fp32 buffer; the slowest rank's times, so all ranks agree."""
    ranks = dist.world_size(group)
    if ranks < 2:
        raise ValueError("link_rate: a link is measured between ranks: run under torchrun with 2 or more "
                         "processes (zf.dist.init()), or give the link's rates (Link(bandwidth, latency))")
    device = dist.device_of(group)
    times = []
    for numel in (small, large):
        t = torch.zeros(numel, device=device)
        dist.barrier(group)
        times.append(_best_of(lambda: dist.all_reduce_sum(t, group), repeats))
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX, group=group)
    t_small, t_large = slowest.tolist()
    per_byte = max(t_large - t_small, 1e-12) / ((large - small) * 4)  # seconds per buffer byte
    bandwidth = 2.0 * (ranks - 1) / ranks / per_byte
    latency = max(t_small - small * 4 * per_byte, 0.0) / (2 * (ranks - 1))
    return Link(bandwidth, latency)


def measure(nodes: int = 1, inter: Link | None = None, group=None) -> Cluster:
    """A ``Cluster`` of this machine's measured rates: ``nodes`` nodes of the current process group's
    size each (one machine measures only its own link: ``inter`` is given, else the same link)."""
    per_node = dist.world_size(group)
    intra = link_rate(group) if per_node > 1 else Link(float("inf"), 0.0)
    backend = torch.distributed.get_backend(group) if dist.is_initialized() else (
        "nccl" if torch.cuda.is_available() else "gloo")
    return Cluster(nodes, per_node, intra, inter or intra, flops=compute_rate(), memory_rate=memory_rate(),
                   accelerator=torch.cuda.is_available(), backend=backend)
