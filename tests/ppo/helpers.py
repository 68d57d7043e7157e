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


def tiny_trainer(tmp_path, tok, *, prompts: int = 16, trainer_kwargs: dict | None = None, **overrides):
    """A PPOTrainer on the tiny Llama policy (a tiny value model unless ``value_mode="fused"``), the vowel
    reward and ``prompts`` demo prompts; ``overrides`` go to :func:`ppo_args`, ``trainer_kwargs`` to the
    trainer (``optimizer``, ``eval_dataset``, ``peft_config``, ...)."""
    from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOTrainer

    args = ppo_args(tmp_path, **overrides)
    return PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_tiny_llama(tok),
        value_model=build_tiny_value_model(tok) if args.value_mode == "separate" else None,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(prompts),
        **(trainer_kwargs or {}),
    )
