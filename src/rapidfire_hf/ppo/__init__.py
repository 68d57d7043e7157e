"""PPO: configuration, pure math, model pieces and the trainer."""

from rapidfire_hf.ppo.config import PPOConfig
from rapidfire_hf.ppo.quantized import load_quantized
from rapidfire_hf.ppo.trainer import Experience, PPOTrainer, Rollout

__all__ = ["Experience", "PPOConfig", "PPOTrainer", "Rollout", "load_quantized"]
