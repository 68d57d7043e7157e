"""The fast rollout engine shared by PPO and ``enable_rapidfire`` (GRPO/RLOO).

``RolloutEngine(model, pad_token_id, stop_token_ids, backend)`` generates on the training weights with a
static KV cache and a GQA-aware, graph-captured decode step (backend "static", the families of docs/models.md) or
through ``model.generate`` (backend "hf"), returning responses, per-token log-probs and masks.
"""

from rapidfire_hf.rollout.engine import BACKENDS, RolloutEngine, generation_mode
from rapidfire_hf.rollout.sampling import process_logits, sample_tokens
from rapidfire_hf.rollout.types import RolloutOutput, SamplingParams

__all__ = [
    "BACKENDS",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "generation_mode",
    "process_logits",
    "sample_tokens",
]
