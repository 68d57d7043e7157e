"""Tiny sweeps for the tests: a 2-layer Llama, 8-token responses, a few updates (about a second each)."""

from __future__ import annotations

from peft import LoraConfig

from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig
from rapidfire_hf.sweep import PPOSweep

# settings both a sweep and a PPOTrainer accept; each test overrides a few
COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    num_ppo_epochs=2,
    learning_rate=1e-3,
    max_steps=3,
    response_length=8,
    temperature=1.0,
    stop_token="eos",
    missing_eos_penalty=0.5,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    seed=0,
)

# three trials that differ in a reward-side, an optimizer-side and a schedule-side setting
TRIALS = {
    "kl0.01": {"kl_coef": 0.01},
    "kl0.2-lr3": {"kl_coef": 0.2, "learning_rate": 3e-3, "seed": 5},
    # rollout batch 8 in micro-batches of 2, two accumulated per optimizer step
    "clip0.1": {
        "cliprange": 0.1,
        "num_ppo_epochs": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
    },
}


def lora_config():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def make_sweep(tokenizer, out_dir, trials, dataset=None, reward_model=None, train_rows_per_forward=None,
               model=None, peft_config=None, **shared):  # fmt: skip
    """A PPOSweep on the vowel task with ``COMMON`` settings (``shared`` overrides them); the tiny Llama and
    :func:`lora_config` unless ``model`` / ``peft_config`` are given."""
    args = PPOConfig(output_dir=str(out_dir), **{**COMMON, **shared})
    return PPOSweep(
        args=args,
        trials=trials,
        model=model if model is not None else build_tiny_llama(tokenizer),
        processing_class=tokenizer,
        reward_funcs=None if reward_model is not None else vowel_reward,
        reward_model=reward_model,
        train_dataset=dataset if dataset is not None else make_prompt_dataset(48),
        peft_config=peft_config if peft_config is not None else lora_config(),
        progress=False,
        train_rows_per_forward=train_rows_per_forward,
    )


def curves(result, keys=("objective/scores", "objective/kl", "loss/value_avg", "policy/approxkl_avg")):
    """``{key: [value per logged update]}`` of a SweepResult or a PPOTrainer log history."""
    history = result if isinstance(result, list) else result.log_history
    return {k: [h[k] for h in history if k in h] for k in keys}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
