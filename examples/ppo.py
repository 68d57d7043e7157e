"""PPO with rapidfire_hf: a complete training script.

Runs as a plain script or under accelerate (one GPU, DDP, DeepSpeed, FSDP):

    python examples/ppo.py --output_dir out/ppo --max_steps 20
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/ppo.py \
        --rapidfire_config config/advanced.yaml --gradient-pipeline-depth 8 --sync-interval 2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 examples/ppo.py --use_cpu   # DDP on CPU

``--rapidfire_config`` takes a preset name (``conservative``, ``balanced``, ``aggressive``), a YAML file
or inline JSON (``'{"gradient_pipeline": true}'``); a bad value is refused before anything loads. Several
processes on a machine without a GPU need ``--use_cpu`` to form one DDP job; without it the script stops
instead of running duplicate jobs.

Without ``--model_name_or_path`` (or TRL's ``--sft_model_path``) it trains the embedded demo policy
(built from a config, no download) on the vowel task; with a local path it trains that causal LM. The
reward is the rule-based ``vowel_reward`` unless ``--reward_model_path`` names a local
sequence-classification model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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

    script.model_name_or_path = script.model_name_or_path or args.sft_model_path
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


def rapidfire_config_arg(text: str):
    """``--rapidfire_config``: a preset name, a YAML path or inline JSON, checked now (not after loading models)."""
    from rapidfire_hf.config import ConfigError, load_config

    value = text
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({err})") from None
    try:
        load_config(value, env=False)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    # PPOConfig.rapidfire_config also takes a dict or a RapidFireConfig in Python, so its type is Any;
    # on the command line it is text.
    for action in parser._actions:
        if action.dest == "rapidfire_config":
            action.type = rapidfire_config_arg
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig]:
    """Parse the command line; stop with a message when the processes would not form one job."""
    script, args = build_parser().parse_args_into_dataclasses(args=argv)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        rank = int(os.environ.get("RANK", "0"))
        raise SystemExit(
            f"examples/ppo.py: launched as {launched} processes (WORLD_SIZE={launched}), but they do not form "
            f"one job (world size {args.world_size}): each would train alone, duplicating the run. "
            + (
                "Without a GPU, add --use_cpu to train one DDP job on CPU (gloo)."
                if not args.use_cpu
                else "Check the launcher's settings (accelerate config, torchrun flags)."
            )
            if rank == 0
            else 1
        )
    return script, args


def main(argv: list[str] | None = None) -> None:
    script, args = parse_args(argv)
    rapidfire_overrides(script, args)
    tok, policy, value = load_models(script, args)
    if script.dataset_path:
        from datasets import load_dataset

        kind = "csv" if script.dataset_path.endswith(".csv") else "json"
        dataset = load_dataset(kind, data_files=script.dataset_path, split="train")
    else:
        dataset = make_prompt_dataset(script.num_prompts)
    reward = {}
    if args.reward_model_path:
        from transformers import AutoModelForSequenceClassification

        reward["reward_model"] = AutoModelForSequenceClassification.from_pretrained(
            args.reward_model_path, num_labels=1
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
    main(sys.argv[1:])
