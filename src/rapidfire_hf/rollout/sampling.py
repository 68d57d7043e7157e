"""Logit processing (temperature, top-k, top-p) and sampling with the sampled token's log-prob.

The processing follows the semantics of HF's ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` applied in that order (tests compare against ``output_scores``). Sampling uses the
Gumbel-max trick on noise drawn outside the step: ``argmax(logp + g)``, ``g = -log(-log(u))``, is an
exact draw from ``softmax(logp)``, and keeping the random draw outside makes the step a pure function of
its input tensors, so it can be captured in a CUDA graph while the caller's ``torch.Generator`` still
decides the outcome.
"""

from __future__ import annotations

import torch

from rapidfire_hf.rollout.types import SamplingParams


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p; filtered entries become ``-inf``.

    Args:
        logits: ``[B, V]`` float32 raw next-token logits.
        temperature: divides the logits.
        top_k: keep tokens whose score is at least the k-th largest (0 disables).
        top_p: keep the most likely tokens whose cumulative mass reaches ``top_p`` (1.0 disables).

    Returns:
        ``[B, V]`` float32 processed scores.
    """
    scores = logits / temperature if temperature != 1.0 else logits
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        # drop a token when the mass of all tokens at most as likely (itself included) is <= 1 - top_p;
        # the most likely token always stays
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        mass_below = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_below <= (1.0 - top_p)
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def philox_seeds(generator: torch.Generator | None, rows: int, device) -> torch.Tensor:
    """``[rows]`` int64 seeds for the fused sampler's own noise (``decode_sampler="triton-philox"``), drawn
    from ``generator`` on its device (the default generator of ``device`` when None), then moved to ``device``."""
    where = generator.device if generator is not None else device
    drawn = torch.randint(0, 2**31 - 1, (rows,), generator=generator, dtype=torch.long, device=where)
    return drawn.to(device)


def gumbel_noise(noise_uniform: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` uniform(0, 1) samples -> Gumbel(0, 1) samples (u = 0 maps to -inf: never picked)."""
    return -torch.log(-torch.log(noise_uniform))


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, noise_uniform: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row and its log-prob under the processed distribution.

    Args:
        logits: ``[B, V]`` float32 raw logits.
        params: sampling settings.
        noise_uniform: ``[B, V]`` float32 uniform(0, 1) noise when ``params.do_sample``, else None.

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``.
    """
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p)
    logp = torch.log_softmax(scores, dim=-1)
    if params.do_sample:
        tokens = torch.argmax(logp + gumbel_noise(noise_uniform), dim=-1)
    else:
        # HF's greedy search takes the argmax of the unwarped scores; warping keeps the argmax
        tokens = torch.argmax(logits, dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
