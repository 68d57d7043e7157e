"""Model shapes of the benchmarks (the library's table, ``rapidfire_hf.demo.shapes``) and token counts."""

from __future__ import annotations

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_shape

__all__ = ["LLAMA_SHAPES", "llama_shape", "tokens_per_update"]


def tokens_per_update(batch: int, prompt_len: int, response_len: int) -> int:
    """Prompt plus response tokens of one rollout batch: the numerator of every tokens/s in the READMEs."""
    return batch * (prompt_len + response_len)
