"""Concurrent PPO sweeps: many LoRA trials trained at once on one shared frozen base model.

``PPOSweep`` keeps one copy of the base weights; each trial owns a LoRA adapter, a value head, an
optimizer, a schedule, a prompt order and random streams, and a trial's results equal that trial trained
alone. Trials can be stopped, resumed and cloned with overrides at update boundaries, from Python, a
callback or another shell (``rapidfire sweep ctl``).
"""

from rapidfire_hf.sweep.control import EarlyStopping, append_command
from rapidfire_hf.sweep.lora import AdapterBank, MultiLoRALinear
from rapidfire_hf.sweep.sweep import PPOSweep, SweepResult
from rapidfire_hf.sweep.trial import PER_TRIAL_FIELDS, trial_args

__all__ = [
    "PER_TRIAL_FIELDS",
    "AdapterBank",
    "EarlyStopping",
    "MultiLoRALinear",
    "PPOSweep",
    "SweepResult",
    "append_command",
    "trial_args",
]
