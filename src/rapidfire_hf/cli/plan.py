"""``rapidfire plan``: PPOTrainer's throughput plan for a model and batch, without training.

Builds the trainer `rapidfire demo` would (its tokenizer, prompts and vowel reward) around a policy of a
named Llama shape (random init, on the GPU when there is one) or a local HF causal LM, then runs the
planner of the first update (``rapidfire_hf.ppo.planning.plan_run``: a one-row probe of the models, the
device's memory, the level's target) and prints its table. No rollout and no training step run.

Examples::

    rapidfire plan --shape smoke --batch 8 --micro 2 --prompt-length 8 --response-length 8
    rapidfire plan --shape llama-7b --batch 160 --micro 8 --value-mode fused --config aggressive
    rapidfire plan --model path/to/llama --json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_SHAPE = "smoke"
DESCRIPTION = (
    "Show the throughput plan PPOTrainer would make (training micro-batch, activation checkpointing, "
    "scoring and generation chunks) for a model and batch, without training."
)


class PlanUsageError(Exception):
    """A mistake in the command line, reported as one line and exit status 2."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``rapidfire plan``."""
    p = subparsers.add_parser(
        "plan", help="show PPOTrainer's throughput plan without training", description=DESCRIPTION
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="Local folder of a HF causal LM (never downloaded).")
    source.add_argument(
        "--shape",
        default=None,
        help=f"A named Llama shape built with random init (default {DEFAULT_SHAPE}), e.g. llama-1.1b, llama-7b.",
    )
    p.add_argument("--batch", type=int, default=64, help="Prompts per rollout batch (default 64).")
    p.add_argument("--micro", type=int, default=8, help="per_device_train_batch_size (default 8).")
    p.add_argument("--mini-batches", type=int, default=1, help="num_mini_batches (default 1).")
    p.add_argument("--prompt-length", type=int, default=128, help="Prompt tokens per row (default 128).")
    p.add_argument("--response-length", type=int, default=384, help="Response tokens per row (default 384).")
    p.add_argument(
        "--config",
        default="balanced",
        help="A rapidfire config: preset name or YAML path (default balanced).",
    )
    p.add_argument(
        "--value-mode",
        choices=("separate", "fused"),
        default=None,
        help="'separate' value model or 'fused' value head (default: separate for a shape, fused for --model).",
    )
    p.add_argument("--score-chunk", default="auto", help="local_rollout_forward_batch_size: 'auto' or rows.")
    p.add_argument(
        "--generation-chunk", default="auto", help="rollout_generation_batch_size: 'auto' or prompts."
    )
    p.add_argument(
        "--output-dir",
        default=None,
        help="Where the probe cache goes (default: a temporary folder, so every call measures).",
    )
    p.add_argument("--json", action="store_true", help="Print the plan as JSON instead of the table.")
    p.set_defaults(func=plan_command)
    return p


def plan_command(args: argparse.Namespace) -> int:
    """Check the flags, build the trainer, plan; print the table (or JSON). Exit 2 on a user mistake."""
    from rapidfire_hf.config import ConfigError

    try:
        _check_args(args)
        if args.output_dir is not None:
            return _plan_and_print(args, Path(args.output_dir))
        with tempfile.TemporaryDirectory(prefix="rapidfire_plan_") as tmp:
            return _plan_and_print(args, Path(tmp))
    except (PlanUsageError, ConfigError) as err:
        print(f"rapidfire plan: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _chunk(flag: str, value: str) -> int | str:
    """``'auto'`` or a positive integer, from the text of ``flag``."""
    if value == "auto":
        return value
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise PlanUsageError(f"{flag} {value!r}: expected 'auto' or a positive integer")
    return rows


def _check_args(args: argparse.Namespace) -> None:
    """Everything the flags alone can get wrong, before any model is built."""
    from rapidfire_hf.config import load_config
    from rapidfire_hf.demo.shapes import LLAMA_SHAPES

    for flag in ("batch", "micro", "mini_batches", "prompt_length", "response_length"):
        if getattr(args, flag) < 1:
            raise PlanUsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.batch % args.micro:
        raise PlanUsageError(f"--batch {args.batch} is not divisible by --micro {args.micro}")
    if args.batch % args.mini_batches:
        raise PlanUsageError(f"--batch {args.batch} is not divisible by --mini-batches {args.mini_batches}")
    args.score_chunk = _chunk("--score-chunk", args.score_chunk)
    args.generation_chunk = _chunk("--generation-chunk", args.generation_chunk)
    if args.model is None:
        args.shape = args.shape or DEFAULT_SHAPE
        if args.shape not in LLAMA_SHAPES:
            raise PlanUsageError(f"unknown shape {args.shape!r}; known: {', '.join(LLAMA_SHAPES)}")
    else:
        path = Path(args.model)
        if not path.is_dir():
            raise PlanUsageError(f"--model {args.model}: no such folder (plan never downloads models)")
        if not (path / "config.json").is_file():
            raise PlanUsageError(f"--model {args.model}: not a HF model folder (no config.json)")
    load_config(args.config)  # a ConfigError now, before minutes of model building


def _plan_and_print(args: argparse.Namespace, out_dir: Path) -> int:
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink) if args.json else contextlib.nullcontext():
        trainer, about = _build_trainer(args, out_dir)
        if not args.json:
            print(about, flush=True)
        plan = plan_for(trainer, args.prompt_length)  # prints the table on the main process
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    return 0


def plan_for(trainer, prompt_length: int):
    """``plan_run`` on the trainer's first prompt batch, left-padded or cut to ``prompt_length`` tokens."""
    import torch

    from rapidfire_hf.ppo.planning import plan_run

    ids = trainer.next_prompts(0)["input_ids"]
    if ids.shape[1] >= prompt_length:
        ids = ids[:, -prompt_length:]  # keep the end: the prompts are left-padded
    else:
        pad = torch.full((ids.shape[0], prompt_length - ids.shape[1]), trainer.pad_token_id, dtype=ids.dtype)
        ids = torch.cat([pad, ids], dim=1)
    return plan_run(trainer, ids.to(trainer.accelerator.device))


def _device():
    """``(device, weight dtype)``: the GPU in bf16 when there is one (fp16 GPUs keep fp32), else the CPU.

    On the GPU the allocator gets expandable segments first, as the trainer's memory callback would set
    them before a model reaches the GPU (the models here are built there directly)."""
    import torch

    from rapidfire_hf.memory.allocator import setup_allocator

    if torch.cuda.is_available():
        setup_allocator()  # before CUDA initialises (is_bf16_supported below initialises it)
        return torch.device("cuda"), torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.device("cpu"), torch.float32


def _build_trainer(args: argparse.Namespace, out_dir: Path):
    """``(PPOTrainer, one line describing the run)``; nothing is trained."""
    import torch

    from rapidfire_hf.demo import make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer

    device, dtype = _device()
    tokens = args.prompt_length + args.response_length
    if args.model is None:
        value_mode = args.value_mode or "separate"
        tok, policy, value = _shape_models(args.shape, tokens, value_mode, device, dtype)
        name = args.shape
    else:
        value_mode = args.value_mode or "fused"
        tok, policy, value = _local_models(Path(args.model), tokens, value_mode, device, dtype)
        name = args.model
    ppo_args = PPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.batch // args.micro,
        num_mini_batches=args.mini_batches,
        response_length=args.response_length,
        local_rollout_forward_batch_size=args.score_chunk,
        rollout_generation_batch_size=args.generation_chunk,
        value_mode=value_mode,
        max_steps=1,
        stop_token="eos",
        num_sample_generations=0,
        report_to=[],
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16,
        rapidfire_config=args.config,
    )
    with _quiet_datasets():
        trainer = PPOTrainer(
            args=ppo_args,
            processing_class=tok,
            model=policy,
            value_model=value,
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(max(64, args.batch)),
        )
    params = sum(p.numel() for p in policy.parameters()) / 1e6
    about = (
        f"policy {name} ({params:,.1f}M parameters, {str(dtype).removeprefix('torch.')}, {value_mode} value) "
        f"on {device.type}; rollout batch {args.batch}, num_mini_batches {args.mini_batches}, micro-batch "
        f"{args.micro}; {args.prompt_length} + {args.response_length} tokens"
    )
    return trainer, about


@contextlib.contextmanager
def _quiet_datasets():
    """No "Tokenizing prompts" progress bar between the command line and the table."""
    from datasets.utils.logging import (
        disable_progress_bar,
        enable_progress_bar,
        is_progress_bar_enabled,
    )

    was_enabled = is_progress_bar_enabled()
    disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            enable_progress_bar()


def _shape_models(shape_name: str, tokens: int, value_mode: str, device, dtype):
    """The demo's character tokenizer (padded to the shape's vocabulary), a random-init policy of the
    shape and (``separate``) a value model of the same shape, built on ``device`` in ``dtype`` directly:
    no fp32 copy of a 7B model on the CPU."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rapidfire_hf.demo import build_char_tokenizer
    from rapidfire_hf.demo.shapes import llama_config, llama_shape

    shape = llama_shape(shape_name)
    tok = build_char_tokenizer(vocab_size=shape["vocab_size"])
    conf = llama_config(shape, max_position_embeddings=tokens + 8)
    torch.manual_seed(0)
    with torch.device(device):
        policy = LlamaForCausalLM._from_config(conf, dtype=dtype)
        value = (
            LlamaForSequenceClassification._from_config(conf, dtype=dtype)
            if value_mode == "separate"
            else None
        )
    policy.generation_config.pad_token_id = tok.pad_token_id
    policy.generation_config.eos_token_id = tok.eos_token_id
    return tok, policy, value


def _local_models(path: Path, tokens: int, value_mode: str, device, dtype):
    """The tokenizer and causal LM in ``path`` (and, ``separate``, a one-label sequence-classification
    model from the same weights as the value model), loaded in ``dtype`` onto ``device``."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    def not_a_model(err: Exception) -> PlanUsageError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return PlanUsageError(f"--model {path}: not a HF causal LM folder ({first})")

    try:  # the config first: a folder that is not a model fails here, before any weight is read
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise not_a_model(err) from None
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise PlanUsageError(
            f"--prompt-length + --response-length = {tokens} tokens; the model in {path} takes at most {limit}"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path)
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device})
        value = None
        if value_mode == "separate":
            value = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=dtype, device_map={"": device}
            )
    except (OSError, ValueError, KeyError) as err:
        raise not_a_model(err) from None
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        raise PlanUsageError(
            f"--model {path}: the tokenizer has no pad token distinct from EOS; add one and save it again"
        )
    tok.padding_side = "left"
    return tok, policy, value
