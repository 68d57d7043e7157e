"""Hugging Face model plumbing shared by the parts: value-head models in TRL's checkpoint format."""

from rapidfire_hf.models.value_head import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
    ValueHead,
)

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2SeqLMWithValueHead",
    "PreTrainedModelWrapper",
    "ValueHead",
]
