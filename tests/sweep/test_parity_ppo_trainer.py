"""A one-trial sweep trains what PPOTrainer trains: fused value head, the same LoRA config, seed and
sampling noise. Tolerance: bit-exact (0) on CPU fp32 for the per-update scores, KL and losses and for the
final adapter weights.

Nothing is carried from the sweep to the trainer: both draw the adapter, the value head, the prompt order
and each rollout's noise from the seed (``rapidfire_hf.ppo.seeds``). The prompts are of one length: the
sweep pads them to the dataset's longest, PPOTrainer to the batch's (``test_reproducible_trials.py``
covers prompts of different lengths). Both score the rollout's values with the adapter on, as their
training steps predict them.
"""

from __future__ import annotations

import pytest

from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig, PPOTrainer

from .helpers import COMMON, curves, lora_config, make_sweep, max_abs_diff


def _trainer_like_the_trial(tokenizer, tmp_path, dataset, **settings):
    args = PPOConfig(
        output_dir=str(tmp_path / "ppo"),
        value_mode="fused",
        rollout_backend="static",
        memory_management=False,
        disable_tqdm=True,
        **{**COMMON, **settings},
    )
    return PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        peft_config=lora_config(),
        reward_funcs=vowel_reward,
        train_dataset=dataset,
    )


# micro-batches of 4 (one per optimizer step), and of 2 (two accumulated per step, with kl_coef and
# clip range off their defaults)
SETTINGS = [
    {},
    {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "kl_coef": 0.2, "cliprange": 0.1},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["micro4", "micro2-accumulate"])
@pytest.mark.usefixtures("single_thread")
def test_one_trial_sweep_matches_ppo_trainer(tokenizer, tmp_path, settings):
    from peft import get_peft_model_state_dict

    dataset = make_prompt_dataset(48, min_len=4, max_len=4)
    sweep = make_sweep(tokenizer, tmp_path / "sweep", {"only": {}}, dataset=dataset, **settings)
    trainer = _trainer_like_the_trial(tokenizer, tmp_path, dataset, **settings)
    trainer.train()
    result = sweep.train()["only"]
    assert curves(trainer.state.log_history) == curves(result)
    theirs = {k.replace(".default", ""): v for k, v in get_peft_model_state_dict(trainer.policy).items()}
    assert max_abs_diff(sweep.adapter_state_dict("only"), theirs) == 0.0
