"""Compute kernels that need only torch (Triton, where used, is imported lazily).

- :func:`chunked_logprobs` / :func:`chunked_logprobs_and_entropy`: token log-probs and entropy from
  hidden states without a ``[N, V]`` logits tensor, with autograd.
- :func:`gqa_decode_attention`: one-token attention over a static KV cache that reads each K/V head once.
"""

from rapidfire_hf.kernels.chunked_logprobs import (
    ChunkedLogprobsFunction,
    chunked_logprobs,
    chunked_logprobs_and_entropy,
)
from rapidfire_hf.kernels.decode_attention import gqa_decode_attention

__all__ = [
    "ChunkedLogprobsFunction",
    "chunked_logprobs",
    "chunked_logprobs_and_entropy",
    "gqa_decode_attention",
]
