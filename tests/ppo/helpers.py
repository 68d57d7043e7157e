"""The small PPO configuration the CPU trainer tests share."""

from __future__ import annotations

from rapidfire_hf.ppo import PPOConfig


def ppo_args(tmp_path, **overrides) -> PPOConfig:
    """Batch 4 x accumulation 2, 2 mini-batches, 2 epochs, 6-token responses ending at EOS, 2 updates."""
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2,
        response_length=6,
        stop_token="eos",
        learning_rate=1e-3,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        temperature=1.0,
        use_cpu=True,
        seed=3,
        num_sample_generations=0,
    )
    return PPOConfig(**{**base, **overrides})
