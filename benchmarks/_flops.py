"""Model FLOPs of a decoder-only transformer, for the TFLOPS the GPU benchmarks report."""
import torch

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16


def flops_per_token(params: int, embedding_params: int, layers: int, width: int, seq: int) -> int:
    """Training FLOPs per token: 6 N, N the parameters less the embedding tables (looked up, not
    multiplied: the token table, and a learned position table where the model has one), plus
    12 L d s for attention's scores and weighted sum, forward and backward, counted as if not
    causal."""
    return 6 * (params - embedding_params) + 12 * layers * width * seq


def embedding_params(model) -> int:
    """Elements of the model's embedding tables (``nn.Embedding``: token and position tables)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
