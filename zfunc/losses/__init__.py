"""Losses users call in their ``loss_fn``, written for memory the step's transforms cannot save
themselves: a language model's logits (tokens x vocabulary) outgrow its activations at large
micro-batches (``chunked_cross_entropy``)."""
from .chunked_ce import chunked_cross_entropy

__all__ = ["chunked_cross_entropy"]
