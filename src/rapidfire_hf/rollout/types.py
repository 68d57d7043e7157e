"""The rollout engine's small typed interface: what to sample, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token; the same meaning as the ``model.generate`` arguments of these names.

    The processed distribution is ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
    tokens (0 = all) and then to the smallest set whose mass reaches ``top_p`` (1.0 = all), in HF's order.
    With ``do_sample=False`` the most likely token is taken (greedy); its log-prob is still reported under
    the processed distribution.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RolloutOutput:
    """One batch of generated responses.

    Attributes:
        sequences: ``[B, P + R]`` int64, the left-padded prompt followed by the response.
        responses: ``[B, R]`` int64, ``R = max_new_tokens``; pad after the stop token.
        logprobs: ``[B, R]`` float32, log-prob of each sampled token under the processed distribution;
            0 after the stop token.
        response_mask: ``[B, R]`` bool, True up to and including the stop token.
        prompt_length: ``P``, the (padded) prompt width.
    """

    sequences: torch.Tensor
    responses: torch.Tensor
    logprobs: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
