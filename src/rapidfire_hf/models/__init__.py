"""Hugging Face model plumbing shared by the parts: where a causal LM's pieces are
(PEFT unwrap, decoder layers, final norm, decoder and head) and value-head models in TRL's checkpoint format."""

from rapidfire_hf.models.plumbing import causal_lm_parts, decoder_layers, final_norm, unwrap_peft
from rapidfire_hf.models.value_head import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
    ValueHead,
    ValueHeadLoadError,
)

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2SeqLMWithValueHead",
    "PreTrainedModelWrapper",
    "ValueHead",
    "ValueHeadLoadError",
    "causal_lm_parts",
    "decoder_layers",
    "final_norm",
    "unwrap_peft",
]
