"""PPOTrainer's data types (a rollout, a scored experience, the trainer state) and small stat helpers."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import TrainerState

from rapidfire_hf.ppo.core import AdvantageOutput


@dataclass
class PPOTrainerState(TrainerState):
    """``TrainerState`` plus the number of prompts trained on so far."""

    episode: int = 0


@dataclass
class Rollout:
    """What generation produced for one batch of prompts (all on the training device)."""

    queries: torch.Tensor  # [B, P] left-padded prompts
    responses: torch.Tensor  # [B, R] generated tokens, pad after the stop token
    logprobs: torch.Tensor  # [B, R] float32 sampled-token log-probs (temperature-scaled)
    extra: dict | None = None  # non-tensor dataset columns, passed to reward functions

    @property
    def query_responses(self) -> torch.Tensor:
        return torch.cat([self.queries, self.responses], dim=1)


@dataclass
class Experience:
    """A scored rollout: everything the PPO epochs consume."""

    rollout: Rollout
    adv: AdvantageOutput
    postprocessed_responses: torch.Tensor  # [B, R] truncated after the stop token


STAT_KEYS = ("approx_kl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")


def _to_float(v):
    return float(v) if isinstance(v, (int, float)) else v


def sync_time(device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (a phase boundary of an update)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # once per phase, to attribute time to phases
    return time.perf_counter()
