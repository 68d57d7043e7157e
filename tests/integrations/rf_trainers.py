"""Builders of tiny TRL trainers (SFT, DPO, GRPO, RLOO) on the demo task's char tokenizer and tiny Llama, on CPU.

Every builder takes the same seed, so a stock trainer and an ``enable_rapidfire`` one start from the same
weights and see the same data order.
"""

from __future__ import annotations

STEPS = 4
# fp32 everywhere so that stock and rapidfire runs compare at fp32 round-off; the precision plugin keeps
# the run in fp32 with the static mode.
PARITY_CONFIG = {"gradient": {"pipeline": True}, "precision": {"mode": "static", "initial": "fp32"}}


def common_args(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        dataloader_num_workers=0,
    )
    args.update(overrides)
    return args


def _words(n):
    import random

    rng = random.Random(0)
    return [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6))) for _ in range(n)
    ]


def build_sft(tokenizer, tmp_path, **overrides):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from rapidfire_hf.demo import build_tiny_llama

    ds = Dataset.from_dict({"text": [f"task: {w} -> {w[::-1]}" for w in _words(64)]})
    args = SFTConfig(**common_args(tmp_path, per_device_train_batch_size=4, max_length=24, **overrides))
    return SFTTrainer(
        model=build_tiny_llama(tokenizer), args=args, train_dataset=ds, processing_class=tokenizer
    )


def build_dpo(tokenizer, tmp_path, **overrides):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from rapidfire_hf.demo import build_tiny_llama

    words = _words(32)
    ds = Dataset.from_dict(
        {
            "prompt": [f"task: {w} ->" for w in words],
            "chosen": [" aeiou" for _ in words],
            "rejected": [f" {w}" for w in words],
        }
    )
    args = DPOConfig(**common_args(tmp_path, per_device_train_batch_size=4, max_length=24, **overrides))
    # the reference is an identical copy (same seed); TRL would otherwise reload it from a hub path
    return DPOTrainer(
        model=build_tiny_llama(tokenizer),
        ref_model=build_tiny_llama(tokenizer),
        args=args,
        train_dataset=ds,
        processing_class=tokenizer,
    )


def _rl_args(tmp_path, overrides):
    return common_args(
        tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, **overrides
    )


def build_grpo(tokenizer, tmp_path, **overrides):
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward

    args = GRPOConfig(**_rl_args(tmp_path, overrides))
    return GRPOTrainer(
        model=build_tiny_llama(tokenizer),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=make_prompt_dataset(64),
        processing_class=tokenizer,
    )


def build_rloo(tokenizer, tmp_path, model_dir=None, **overrides):
    from trl import RLOOConfig, RLOOTrainer

    from rapidfire_hf.demo import make_prompt_dataset, vowel_reward

    args = RLOOConfig(**_rl_args(tmp_path, overrides))
    # from a local path: RLOO (beta 0.05 by default) loads its reference model from the policy's path
    return RLOOTrainer(
        model=str(model_dir),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=make_prompt_dataset(64),
        processing_class=tokenizer,
    )


def build_reward(tokenizer, tmp_path, **overrides):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from rapidfire_hf.demo import build_tiny_reward_model

    words = _words(32)
    ds = Dataset.from_dict(
        {"chosen": [f"task: {w} -> aeiou" for w in words], "rejected": [f"task: {w} -> {w}" for w in words]}
    )
    args = RewardConfig(**common_args(tmp_path, per_device_train_batch_size=4, max_length=24, **overrides))
    return RewardTrainer(
        model=build_tiny_reward_model(tokenizer, seed=0),
        args=args,
        train_dataset=ds,
        processing_class=tokenizer,
    )


BUILDERS = {
    "reward": build_reward,
    "sft": build_sft,
    "dpo": build_dpo,
    "grpo": build_grpo,
    "rloo": build_rloo,
}


def train_log(trainer, key="loss"):
    """Per-step values of ``key`` from the trainer's log history (training logs only)."""
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]
