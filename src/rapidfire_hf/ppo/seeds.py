"""Every random draw of a PPO run, from its ``seed`` alone: the one rule that ``PPOTrainer`` and each trial of
a ``PPOSweep`` follow, so that a trial of a sweep is the run ``PPOTrainer`` makes alone with the trial's
settings and seed.

* the prompt order: a fresh permutation of the prompts per pass over the data, seeded ``seed + pass``
  (:func:`prompt_order`, a :class:`~rapidfire_hf.ppo.data.PromptOrder`);
* the sampling noise of rollout number ``update``: a generator seeded from ``(seed, update, rank)``
  (:func:`sampling_generator`). A fresh seed per update, rather than one stream for the whole run, because
  a batched decode ends when its last row stops: a stream shared over updates would advance by a count
  that depends on the rows decoded beside the run's own (a sweep's other trials). A resumed run needs no
  saved state to continue it either;
* the row order of each PPO epoch: one generator seeded ``seed`` for the whole run, drawn once per epoch
  (:func:`permutation_generator`; checkpointed with the run);
* a new LoRA adapter: A Kaiming-uniform, B zero (peft's default init), drawn from ``seed``
  (:func:`init_lora`);
* a new fused value head: drawn from ``seed + 1`` (:func:`new_value_head`).

None of them touches the global RNG, so what the user's code draws before or after does not change a run.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rapidfire_hf.models.value_head import ValueHead
from rapidfire_hf.ppo.data import PromptOrder

# makes the per-rank streams of one seed distinct (TRL's ``local_seed`` offset, a prime)
_RANK_STRIDE = 100_003


def sampling_generator(seed: int, update: int, rank: int = 0) -> torch.Generator:
    """The generator of the sampling noise of rollout number ``update`` (0-based) on process ``rank``."""
    base = seed + rank * _RANK_STRIDE
    return torch.Generator().manual_seed((base * 1_000_003 + update) % (2**63 - 1))


def permutation_generator(seed: int) -> torch.Generator:
    """The generator every PPO epoch's row order is drawn from (``randperm`` once per epoch)."""
    return torch.Generator().manual_seed(seed)


def prompt_order(
    num_rows: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
) -> PromptOrder:
    """The prompts of each rollout batch: ``batch_size`` (all processes together) of ``num_rows`` prompts."""
    return PromptOrder(num_rows, batch_size, seed, rank, world_size)


def _forked(device: torch.device):
    """The global RNGs of the CPU (and of ``device`` when it is a GPU) as they were, after the block."""
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def init_lora(pairs: list[tuple[torch.Tensor, torch.Tensor]], seed: int) -> None:
    """Initialise LoRA pairs ``(A [r, in], B [out, r])`` in the given order (the model's module order): A
    Kaiming-uniform, B zero, as peft's default ``init_lora_weights=True``, drawn from ``seed`` alone."""
    if not pairs:
        return
    with _forked(pairs[0][0].device), torch.no_grad():
        torch.manual_seed(seed)
        for a, b in pairs:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            nn.init.zeros_(b)


def new_value_head(hidden_size: int, seed: int) -> ValueHead:
    """A fused value head drawn from ``seed + 1`` (on the CPU, in fp32; the caller places it)."""
    with _forked(torch.device("cpu")):
        torch.manual_seed(seed + 1)
        return ValueHead(hidden_size)
