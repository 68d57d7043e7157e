"""PPO: configuration, pure math, model pieces and the trainer.

The names TRL 1.12's ``trl.experimental.ppo`` exported (value-head models, ``batch_generation`` and the
masked statistics) are importable from here too.
"""

from rapidfire_hf.models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
)
from rapidfire_hf.ppo.compat import batch_generation, masked_mean, masked_var, masked_whiten
from rapidfire_hf.ppo.config import PPOConfig
from rapidfire_hf.ppo.quantized import load_quantized
from rapidfire_hf.ppo.recipe import (
    trainer as ppo_trainer,  # TRL's module name, for `from ... import ppo_trainer`
)
from rapidfire_hf.ppo.recipe.trainer import PPOTrainer
from rapidfire_hf.ppo.types import Experience, Rollout

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2SeqLMWithValueHead",
    "Experience",
    "PPOConfig",
    "PPOTrainer",
    "PreTrainedModelWrapper",
    "Rollout",
    "batch_generation",
    "load_quantized",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_trainer",
]
