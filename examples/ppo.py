"""PPO with rapidfire_hf: a complete training script.

Runs as a plain script or under accelerate (one GPU, DDP, DeepSpeed, FSDP):

    python examples/ppo.py --output_dir out/ppo --max_steps 20
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/ppo.py \
        --rapidfire_config config/advanced.yaml --gradient-pipeline-depth 8 --sync-interval 2

Without ``--model_name_or_path`` it trains the embedded demo policy (built from a config, no
download) on the vowel task; with a local path it trains that causal LM. The reward is the rule-based
``vowel_reward`` unless ``--reward_model_path`` names a local sequence-classification model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from rapidfire_hf import PPOConfig, PPOTrainer
from rapidfire_hf.demo import DemoTask, make_prompt_dataset, vowel_reward


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local policy path (default: demo policy)."}
    )
    value_model_path: str | None = field(
        default=None, metadata={"help": "Local value model (default: fused head or demo)."}
    )
    reward_model_path: str | None = field(
        default=None, metadata={"help": "Local reward model (default: vowel_reward)."}
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "A local JSON/JSONL/CSV file with a `prompt` column (default: synthetic)."},
    )
    num_prompts: int = field(default=1024, metadata={"help": "Synthetic prompts when no dataset is given."})
    use_peft: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter (the reference is the base)."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    gradient_pipeline_depth: int | None = field(
        default=None, metadata={"help": "Overrides gradient.pipeline_depth of the rapidfire config."}
    )
    sync_interval: int | None = field(default=None, metadata={"help": "Overrides gradient.sync_interval."})


def load_models(script: ScriptArguments, args: PPOConfig):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    if script.model_name_or_path is None:
        tok, policy, value, _ = DemoTask().build()
        return tok, policy, value if script.value_model_path is None else None
    tok = AutoTokenizer.from_pretrained(script.model_name_or_path, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    value = None
    if script.value_model_path:
        value = AutoModelForSequenceClassification.from_pretrained(script.value_model_path, num_labels=1)
    elif args.value_mode != "fused":
        raise SystemExit("Give --value_model_path or --value_mode fused when training your own model.")
    return tok, policy, value


def rapidfire_overrides(script: ScriptArguments, args: PPOConfig) -> None:
    """Command-line knobs beat the config file; they travel as RAPIDFIRE_* variables to every rank."""
    if script.gradient_pipeline_depth is not None:
        os.environ["RAPIDFIRE_GRADIENT_PIPELINE_DEPTH"] = str(script.gradient_pipeline_depth)
    if script.sync_interval is not None:
        os.environ["RAPIDFIRE_GRADIENT_SYNC_INTERVAL"] = str(script.sync_interval)
    if (script.gradient_pipeline_depth or script.sync_interval) and args.rapidfire_config is None:
        args.rapidfire_config = "balanced"


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    script, args = parser.parse_args_into_dataclasses()
    rapidfire_overrides(script, args)
    tok, policy, value = load_models(script, args)
    if script.dataset_path:
        from datasets import load_dataset

        kind = "csv" if script.dataset_path.endswith(".csv") else "json"
        dataset = load_dataset(kind, data_files=script.dataset_path, split="train")
    else:
        dataset = make_prompt_dataset(script.num_prompts)
    reward = {}
    if script.reward_model_path:
        from transformers import AutoModelForSequenceClassification

        reward["reward_model"] = AutoModelForSequenceClassification.from_pretrained(
            script.reward_model_path, num_labels=1
        )
    else:
        reward["reward_funcs"] = vowel_reward
    peft_config = None
    if script.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, target_modules="all-linear")
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        value_model=value,
        train_dataset=dataset,
        peft_config=peft_config,
        **reward,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
