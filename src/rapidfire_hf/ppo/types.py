"""PPO's data types, shared by PPOTrainer and PPOSweep: a rollout, a scored experience, the statistics of the
PPO epochs, the trainer state."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import TrainerState

from rapidfire_hf.ppo.core import AdvantageOutput, LossOutput


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


@dataclass
class PPOStats:
    """The statistics of one update's PPO epochs: a value per training forward, each field a device tensor
    ``[num_ppo_epochs, num_mini_batches, forwards per window]`` (TRL 1.12's ``*_stats`` arrays).

    Written by :meth:`record` after every training forward (PPOTrainer's and each sweep trial's); the
    reporter logs their means (``ppo/reporting.update_device_metrics``). ``stats["pg_loss"]`` reads a field
    by name, as the dict ``PPOTrainer.optimize`` returned before.
    """

    approx_kl: torch.Tensor
    pg_clipfrac: torch.Tensor
    pg_loss: torch.Tensor
    vf_loss: torch.Tensor
    vf_clipfrac: torch.Tensor
    entropy: torch.Tensor
    ratio: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, int, int], device) -> PPOStats:
        return cls(**{f.name: torch.zeros(shape, device=device) for f in fields(cls)})

    def record(self, pos: tuple[int, int, int], out: LossOutput, entropy: torch.Tensor) -> None:
        """One forward's loss statistics and mean entropy at ``(epoch, mini-batch, forward)``."""
        self.approx_kl[pos] = out.approx_kl.detach()
        self.pg_clipfrac[pos] = out.pg_clipfrac.detach()
        self.pg_loss[pos] = out.pg_loss.detach()
        self.vf_loss[pos] = out.vf_loss.detach()
        self.vf_clipfrac[pos] = out.vf_clipfrac.detach()
        self.entropy[pos] = entropy.detach()
        self.ratio[pos] = out.ratio_mean.detach()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in {f.name for f in fields(self)}:
            raise KeyError(f"{name!r}: PPOStats has {', '.join(f.name for f in fields(self))}")
        return getattr(self, name)


@dataclass(frozen=True)
class TrainedParts:
    """What saving, exporting and resuming read of a PPOTrainer (``PPOTrainer.trained_parts()``): the
    checkpoint and export functions take this, never the trainer, and return what the trainer assigns."""

    args: Any  # the PPOConfig
    accelerator: Any  # the trainer's Accelerator (processes, rank, main process, barrier)
    module: Any  # the unwrapped PolicyAndValue: the policy and the value model or fused head
    tokenizer: Any  # the processing class, saved beside the policy
    optimizer: Any
    lr_scheduler: Any
    state: PPOTrainerState  # global_step, episode, log history (written, and read back on resume)
    ref_model: Any  # the separate frozen reference, or None (fingerprinted in the run's identity)
    reward_model: Any  # or None (reward functions)
    num_train_prompts: int  # rows of train_dataset (the prompt order depends on them)
    permutation: torch.Generator  # the PPO epochs' row-order generator (its state is saved and restored)


@dataclass(frozen=True)
class RunState:
    """What a :class:`~rapidfire_hf.ppo.recipe.trainer.PPOTrainer` holds and has done so far, read-only
    (``trainer.run_state``; a fresh copy at each read): for benchmark scripts and ``rapidfire demo``."""

    rollout_backend: str | None  # the rollout engine's ("static" / "hf"); None before the first rollout
    fused_copy_bytes: int | None  # bytes of the fused decode projections' weight copies; None: no such engine
    oom_splits: int  # micro-batches split and retried after a CUDA OOM, so far
    trainable_parameters: int  # elements of the trained parameters (ZeRO-3: their full size, ``ds_numel``)
    trainable_dtypes: tuple[str, ...]  # the trained parameters' dtypes, sorted ("bfloat16", "float32", ...)
    # how the last rollout's decode steps ran (RolloutEngine.decode_mode_ran: "compile", "cuda_graph", "eager",
    # "generate"; None before the first rollout) and each fall back to a lower mode so far, in order
    decode_mode_ran: str | None = None
    decode_fallbacks: tuple[str, ...] = ()


def _to_float(v):
    return float(v) if isinstance(v, (int, float)) else v


def sync_time(device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (a phase boundary of an update)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # once per phase, to attribute time to phases
    return time.perf_counter()
