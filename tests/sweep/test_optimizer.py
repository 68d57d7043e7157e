"""A sweep trial's optimizer and LR schedule are PPOTrainer's default ones, built by the same functions
(``ppo/default_optimizer.default_adamw``, ``default_adamw_kernel``, ``default_scheduler``; issue 28): the same AdamW
settings and the same learning rate at every update, ``lr_scheduler_kwargs`` included."""

from __future__ import annotations

import warnings

import torch

from tests.ppo.helpers import tiny_trainer

from .helpers import make_sweep

# a schedule whose shape depends on lr_scheduler_kwargs (two cosine cycles) and on the warm-up
SCHEDULE = dict(
    lr_scheduler_type="cosine_with_restarts",
    lr_scheduler_kwargs={"num_cycles": 2},
    warmup_steps=1,
    max_steps=6,
    learning_rate=2e-3,
    weight_decay=0.1,
    adam_beta2=0.99,
)


def _lrs(scheduler, steps: int) -> list[float]:
    out = []
    with warnings.catch_warnings():  # stepped without optimizer steps, on purpose
        warnings.simplefilter("ignore")
        for _ in range(steps):
            out.append(scheduler.get_last_lr()[0])
            scheduler.step()
    return out


def test_a_trial_builds_the_optimizer_and_schedule_ppo_trainer_builds(tokenizer, tmp_path):
    trainer = tiny_trainer(tmp_path / "trainer", tokenizer, **SCHEDULE)
    sweep = make_sweep(tokenizer, tmp_path / "sweep", {"a": {}}, **SCHEDULE)
    trial = sweep.trials["a"]
    inner = trainer.optimizer.optimizer  # under accelerate's wrapper
    assert type(inner) is type(trial.optimizer) is torch.optim.AdamW
    for key in ("lr", "betas", "eps", "weight_decay", "fused", "foreach"):
        assert inner.defaults[key] == trial.optimizer.defaults[key], key
    expected = _lrs(trial.scheduler, 6)
    assert _lrs(trainer.lr_scheduler, 6) == expected
    # warm-up, then the second cycle restarts near the peak (one cycle would only decay): the kwargs acted
    assert expected[0] == 0.0 and expected[1] == 2e-3 and expected[4] > 4 * expected[3]
