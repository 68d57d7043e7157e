"""The ``model.generate`` fallback: any HF causal LM (PEFT included), any device.

Log-probs without ``output_scores``: keeping every step's processed scores costs ``R x B x V x 4`` bytes
(12.6 GB at R=384, B=256, V=32000). Instead a logits processor applies our own temperature/top-k/top-p
(HF's own warpers are switched off, so the distribution is unchanged) and keeps only the last step's
log-softmax; the next call, which sees the token that was picked, gathers its log-prob.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rapidfire_hf.models import unwrap_peft
from rapidfire_hf.rollout.sampling import process_logits
from rapidfire_hf.rollout.types import SamplingParams


class _ProcessAndRecord(LogitsProcessor):
    """Warps scores like HF's temperature/top-k/top-p warpers and records the picked tokens' log-probs."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.prev_logp: torch.Tensor | None = None  # [B, V] log-softmax of the previous step
        self.picked: list[torch.Tensor] = []  # each [B]

    def take(self, tokens: torch.Tensor) -> None:
        """Gather the previous step's log-prob of ``tokens`` ``[B]``."""
        if self.prev_logp is not None:
            self.picked.append(self.prev_logp.gather(-1, tokens[:, None]).squeeze(-1))
            self.prev_logp = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.take(input_ids[:, -1])
        p = self.params
        processed = process_logits(scores.float(), p.temperature, p.top_k, p.top_p)
        self.prev_logp = torch.log_softmax(processed, dim=-1)
        return processed


@contextlib.contextmanager
def _only_these_stops(model, stop_token_ids: list[int]):
    """``generate`` falls back to ``model.generation_config.eos_token_id`` when given none; hide it meanwhile."""
    gen_config = unwrap_peft(model).generation_config
    saved = gen_config.eos_token_id
    gen_config.eos_token_id = list(stop_token_ids) or None
    try:
        yield
    finally:
        gen_config.eos_token_id = saved


def hf_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    pad_token_id: int,
    stop_token_ids: list[int],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate with ``model.generate`` (model already in eval mode, under ``no_grad``).

    Args:
        model: an HF causal LM or a PEFT model wrapping one.
        input_ids: ``[B, P]`` left-padded prompts.
        attention_mask: ``[B, P]`` 1 for real tokens.
        params: sampling settings.
        pad_token_id: written after a row has stopped.
        stop_token_ids: token ids that end a row (may be empty).
        generator: seeds the draw (HF's sampler uses the global RNG, so a seed drawn from this generator
            is installed in a forked RNG state).

    Returns:
        ``(tokens [B, R'], logprobs [B, R'])`` with ``R' <= max_new_tokens`` (HF stops when all rows stop).
    """
    recorder = _ProcessAndRecord(params)
    # HF's own warpers off (ours run in the processor); they only exist when sampling
    warpers_off = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if params.do_sample else {}
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=params.do_sample,
        **warpers_off,
        pad_token_id=pad_token_id,
        eos_token_id=list(stop_token_ids) or None,
        use_cache=True,  # TRL sets config.use_cache=False with gradient checkpointing
    )
    devices = [input_ids.device] if input_ids.device.type == "cuda" else []
    with (
        _only_these_stops(model, stop_token_ids),
        torch.random.fork_rng(devices=devices, enabled=generator is not None),
    ):
        if generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            torch.manual_seed(seed)
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
        )
    tokens = sequences[:, input_ids.shape[1] :]
    recorder.take(tokens[:, -1])
    return tokens, torch.stack(recorder.picked, dim=1)
