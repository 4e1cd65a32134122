"""Cross-entropy over an LM head, a chunk of tokens at a time: the logits never exist whole.

``F.cross_entropy(hidden @ weight.T, labels)`` holds tokens x vocabulary logits in forward and
their gradient in backward (for 8k tokens and a 128k vocabulary, 4 GiB in fp32 each), more than a
whole block's activations; under ``zf.recompute`` and offload they bound the micro-batch. Here
forward computes each chunk's logits, keeps only each token's log-sum-exp (one float a token) and
drops them; backward computes each chunk's logits again from the saved ``hidden`` and ``weight``
and turns them into that chunk's gradients at once. Peak memory beyond the inputs is one chunk's
logits (``chunk_size`` x vocabulary, fp32) and the weight's fp32 gradient.

The arithmetic is ``F.cross_entropy``'s: logits in the inputs' dtype (as the matrix product a model
computes), softmax and the loss in fp32, the logits' gradient cast back to the inputs' dtype for the
two products; the weight's gradient adds up in fp32 across chunks. The weight may be a zfunc
parameter under ZeRO-3: it is saved like any tensor autograd keeps, so the step's saved-tensor hooks
keep a handle, and backward re-gathers the unit (docs/architecture.md).
"""
from __future__ import annotations

import torch


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          bias: torch.Tensor | None = None, chunk_size: int = 1024, ignore_index: int = -100,
                          reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=..., reduction=...)`` without all
    logits at once (module docstring); with ``bias``, of ``F.linear(hidden, weight, bias)``.

    ``hidden``: ``(..., d)``; ``weight``: the head's ``(vocabulary, d)`` (a tied embedding's too);
    ``bias``: the head's ``(vocabulary,)``, if it has one;
    ``labels``: ``hidden``'s leading shape, integer, ``ignore_index`` where no token is predicted.
    ``chunk_size``: tokens a chunk. ``reduction``: ``"mean"`` over the tokens not ignored (NaN if
    all are, as F.cross_entropy) or ``"sum"``. The loss is fp32 whatever the inputs' dtype.
    """
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.overrides.has_torch_function(tensors):
        # a tensor subclass (zfunc's stand-in for a parameter a State holds) resolves first, as for any
        # torch function, so the autograd graph meets the unit's materialized value, not the stand-in
        return torch.overrides.handle_torch_function(
            chunked_cross_entropy, tensors, hidden, weight, labels, bias=bias, chunk_size=chunk_size,
            ignore_index=ignore_index, reduction=reduction)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_size must be an int >= 1, got {chunk_size!r}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"chunked_cross_entropy: hidden (..., d) and weight (vocabulary, d) must share d, got "
                         f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1] or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"chunked_cross_entropy: labels must be integers shaped like hidden without its last "
                         f"dimension, {tuple(hidden.shape[:-1])}, got {labels.dtype} {tuple(labels.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"chunked_cross_entropy: bias must be weight's (vocabulary,) in its dtype, "
                         f"{tuple(weight.shape[:1])} {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"chunked_cross_entropy: hidden and weight must share a dtype (the logits' matrix "
                         f"product runs in it), got {hidden.dtype} and {weight.dtype}")
    return _ChunkedCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1).long(),
                                      chunk_size, ignore_index, reduction == "mean")


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: int,
                  end: int) -> torch.Tensor:
    """One chunk's logits in the inputs' dtype (as the model's head computes them), then fp32."""
    if bias is None:
        return (hidden[start:end] @ weight.T).float()
    return torch.nn.functional.linear(hidden[start:end], weight, bias).float()


def _shifted(logits: torch.Tensor) -> torch.Tensor:
    """Each row less its largest, in place: log-softmax as F.cross_entropy forms it (``shifted -
    log sum exp(shifted)``), so a confident token's small loss is not the difference of two large
    numbers. Backward finds the same maxima in the same recomputed logits, so only the sums are kept."""
    return logits.sub_(logits.amax(dim=-1, keepdim=True))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward keeps one float a token (the log-sum-exp of its shifted logits); backward recomputes
    each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, ignore_index, mean):
        n = hidden.shape[0]
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)  # an ignored token gathers class 0, then counts for nothing
        sums = torch.empty(n, dtype=torch.float32, device=hidden.device)  # log sum exp of the shifted logits
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            shifted = _shifted(_chunk_logits(hidden, weight, bias, start, end))
            sums[start:end] = torch.logsumexp(shifted, dim=-1)
            target = shifted.gather(1, safe[start:end, None]).squeeze(1)
            total += torch.where(valid[start:end], sums[start:end] - target, 0.0).sum()
            del shifted
        count = valid.sum().float()
        ctx.save_for_backward(hidden, weight, bias, safe, valid, sums, count)
        ctx.chunk, ctx.mean = chunk, mean
        return total / count if mean else total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, safe, valid, sums, count = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # all tokens ignored: the loss is NaN and the gradients are zeros, as F.cross_entropy's
        scale = grad.float() / count.clamp(min=1) if ctx.mean else grad.float()
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            # d loss / d logits: softmax minus the label's one-hot, times the reduction's scale, 0 if ignored
            g = torch.exp_(_shifted(_chunk_logits(hidden, weight, bias, start, end)).sub_(sums[start:end, None]))
            v = valid[start:end]
            g.scatter_add_(1, safe[start:end, None], -v[:, None].float())
            g.mul_((v.float() * scale)[:, None])
            g = g.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = g @ weight
            if need_weight:
                grad_weight.addmm_(g.T.float(), hidden[start:end].float())
            if need_bias:
                grad_bias += g.float().sum(0)
            del g
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype), None, None, None, None)
