"""Tensor sizes for the optimizer benchmarks (cpu_adam.py, cuda_adam.py): read from the command
line ("10M"), and a model's mix of them."""
import math
import random


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def mixed_sizes(total: int, count: int = 200, seed: int = 0) -> list[int]:
    """``count`` tensor sizes summing to ``total``, log-uniform over three
    decades: a few large matrices, many mid-size ones, small vectors."""
    rng = random.Random(seed)
    weights = [math.exp(rng.uniform(0.0, 7.0)) for _ in range(count)]
    sizes = [max(1, int(w * total / sum(weights))) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes
