"""An applied row is read: every PPOConfig field the contract says an entry point applies is read by that
entry point's code during construction and one update (a recording PPOConfig notes each read outside the
checks themselves). A field that only its checks read would be accepted and ignored: the test names it."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from rapidfire_hf.config.contract import SWEEP, TRAINER
from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from rapidfire_hf.ppo.field_facts import PPO_ROWS

NAMES = frozenset(f.name for f in dataclasses.fields(PPOConfig))
# reads that check or copy every field, not apply one
CHECKERS = ("ppo/config.py", "config/contract.py", "ppo/settings_check.py", "dataclasses.py", "copy.py",
            "training_args.py", "reprlib.py")  # fmt: skip

# applied fields this run cannot reach, each with where it is applied
READ_ELSEWHERE = {
    "tf32": "transformers sets torch's TF32 switches in TrainingArguments.__post_init__",
    "activation_checkpointing_kwargs": "read with gradient_checkpointing on",
    "gradient_checkpointing_kwargs": "read with gradient_checkpointing on",
    "liger_kernel_config": "read with use_liger_kernel on (CUDA)",
    "torch_compile_backend": "read with torch_compile on",
    "torch_compile_mode": "read with torch_compile on",
    "approx_kl_limit": "read with a RapidFireOptimizer (refused by name without one)",
    "exp_name": "names run_name in PPOConfig.__post_init__",
    "run_name": "read by the report_to callbacks (none here)",
    "project": "read by transformers' trackio callback (report_to=['trackio'])",
    "trackio_space_id": "read by transformers' trackio callback",
    "trackio_bucket_id": "read by transformers' trackio callback",
    "trackio_static_space_id": "read by transformers' trackio callback",
    "hub_model_id": "read by trainer.push_to_hub()",
    "hub_token": "read by trainer.push_to_hub()",
    "hub_private_repo": "read by trainer.push_to_hub()",
    "stop_token_id": "read when stop_token is not 'eos' (here it is)",
    "warmup_steps": "read through TrainingArguments.get_warmup_steps",
    "gradient_accumulation_steps": "read through PPOConfig.local_batch_size",
    "num_train_epochs": "read when max_steps is not set",
    "total_episodes": "read when max_steps is not set",
    "use_cpu": "read when CUDA is available",
    "rollout_decode_fuse_projections": "read by the plan for the static engine on CUDA",
    "rollout_decode_fuse_lora": "read by the plan for the static engine on CUDA",
}


class Recording(PPOConfig):
    """A PPOConfig that notes which fields are read, and from where."""

    reads: set = set()
    on = False

    def __getattribute__(self, name):
        if Recording.on and name in NAMES:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if not caller.endswith(CHECKERS):
                Recording.reads.add(name)
        return object.__getattribute__(self, name)


COMMON = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, num_ppo_epochs=1,
              learning_rate=1e-3, max_steps=1, response_length=6, temperature=1.0, stop_token="eos", logging_steps=1,
              report_to=[], use_cpu=True, seed=0, value_mode="fused", save_strategy="steps", save_steps=1)  # fmt: skip


def _run(entry, tokenizer, tmp_path):
    Recording.reads = set()
    if entry == TRAINER:
        args = Recording(output_dir=str(tmp_path), num_sample_generations=1, **COMMON)
        Recording.on = True
        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=build_tiny_llama(tokenizer),
                             reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(16),
                             eval_dataset=make_prompt_dataset(8))  # fmt: skip
        trainer.train()
    else:
        from peft import LoraConfig

        from rapidfire_hf.sweep import PPOSweep

        args = Recording(output_dir=str(tmp_path), **COMMON)
        Recording.on = True
        PPOSweep(args=args, trials={"a": {}}, model=build_tiny_llama(tokenizer), processing_class=tokenizer,
                 train_dataset=make_prompt_dataset(16), reward_funcs=vowel_reward,
                 peft_config=LoraConfig(r=2, target_modules=["q_proj"]), progress=False).train()  # fmt: skip
    Recording.on = False
    return Recording.reads


@pytest.mark.parametrize("entry", [TRAINER, SWEEP])
def test_every_applied_field_is_read_by_the_entry_point(entry, tokenizer, tmp_path):
    reads = _run(entry, tokenizer, tmp_path)
    applied = {n for n, row in PPO_ROWS.items() if row[entry].verdict == "applied"}
    assert len(reads) > 30, "the recorder saw almost nothing: it is broken"
    assert sorted(applied - reads - set(READ_ELSEWHERE)) == [], "applied in the contract, never read"
