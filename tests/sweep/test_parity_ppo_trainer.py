"""A one-trial sweep trains what PPOTrainer trains: fused value head, the same LoRA config, seed and
sampling noise. Tolerance: bit-exact (0) on CPU fp32 for the per-update scores, KL and losses and for the
final adapter weights.

The two differ in two things set up here: the sweep pads prompts to the dataset's longest (PPOTrainer
to the batch's; equal-length prompts make them the same); and the sweep draws each rollout's noise from a
generator seeded per update (PPOTrainer takes the global RNG; its engine is given the same generators).
Both score the rollout's values with the adapter on, as their training steps predict them.
"""

from __future__ import annotations

import pytest

from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from rapidfire_hf.rollout import RolloutEngine
from rapidfire_hf.sweep.trial import update_generator

from .helpers import COMMON, curves, lora_config, make_sweep, max_abs_diff


def _trainer_like_the_trial(tokenizer, tmp_path, dataset, sweep, name, **settings):
    from peft import set_peft_model_state_dict

    args = PPOConfig(
        output_dir=str(tmp_path / "ppo"),
        value_mode="fused",
        rollout_backend="static",
        memory_management=False,
        disable_tqdm=True,
        **{**COMMON, **settings},
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        peft_config=lora_config(),
        reward_funcs=vowel_reward,
        train_dataset=dataset,
    )
    # start from the trial's initial adapter and value head
    set_peft_model_state_dict(trainer.policy, sweep.adapter_state_dict(name))
    trainer.model.value_head.load_state_dict(sweep.trials[name].value_head.state_dict())
    engine = RolloutEngine(trainer.policy, tokenizer.pad_token_id, [tokenizer.eos_token_id], backend="static")
    generate = engine.generate

    def seeded(ids, mask, params):
        return generate(ids, mask, params, generator=update_generator(args.seed, trainer.state.global_step))

    engine.generate = seeded
    trainer._rollout_engine = engine
    return trainer


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
    trainer = _trainer_like_the_trial(tokenizer, tmp_path, dataset, sweep, "only", **settings)
    trainer.train()
    result = sweep.train()["only"]
    assert curves(trainer.state.log_history) == curves(result)
    theirs = {k.replace(".default", ""): v for k, v in get_peft_model_state_dict(trainer.policy).items()}
    assert max_abs_diff(sweep.adapter_state_dict("only"), theirs) == 0.0
