"""``rapidfire plan``: PPOTrainer's throughput plan for a model and batch, without training.

Two ways, one planner (``rapidfire_hf.memory.planner.make_plan``):

- for a card you do not have (``--gpu-memory GiB``, and for a named shape on a machine without a GPU): the
  plan is made from the model's shape alone (``rapidfire_hf.memory.card_plan``): weights, gradients,
  optimizer state and the activation bytes of a row computed, nothing allocated (a 7B plan runs in a few
  hundred MiB of host memory; ``--model`` reads only its ``config.json``);
- on this machine's GPU (no ``--gpu-memory``): the trainer `rapidfire demo` would build (its tokenizer,
  prompts and vowel reward) around a policy of a named Llama shape or a local HF causal LM, then the planner
  of its first update (``rapidfire_hf.ppo.recipe.planning.plan_run``: a one-row probe of the models, the device's
  memory, the level's target). No rollout and no training step run.

A plan that does not fit prints its table (or JSON) and one line on stderr saying what would make it fit,
and exits 1; a model that cannot even be built here exits 1 with one line. User mistakes exit 2.

Examples::

    rapidfire plan --shape smoke --batch 8 --micro 2 --prompt-length 8 --response-length 8
    rapidfire plan --shape llama-7b --gpu-memory 80 --batch 160 --value-mode fused --config aggressive
    rapidfire plan --model path/to/llama --json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
import tempfile
from pathlib import Path

from rapidfire_hf.cli.json_output import JsonStdout

EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 1
MAX_GPU_GIB = 1 << 20  # a card of a PiB: anything above is a typo
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
    p.add_argument(
        "--gpu-memory",
        default=None,
        help="Plan for a card of this many GiB (its total memory as torch reports it; an H100 80GB reports "
        "79.2) from the model's shape alone: nothing is built or allocated. Default: this machine's GPU; a "
        "named shape on a machine without one is planned for an 80 GiB card.",
    )
    p.add_argument(
        "--reward",
        choices=("rule", "model"),
        default="rule",
        help="'rule': the demo's vowel reward (default); 'model': a reward model of the policy's shape "
        "(planned only with --gpu-memory or without a GPU).",
    )
    p.add_argument(
        "--peft",
        action="store_true",
        help="LoRA r=16 on q/k/v/o (planned only with --gpu-memory or without a GPU).",
    )
    p.add_argument(
        "--frozen-quantization",
        choices=("8bit", "4bit", "auto"),
        default=None,
        help="The reference and reward models held in 8 or 4 bits (PPOConfig's ref_model_quantization / "
        "reward_model_quantization; planned only with --gpu-memory or without a GPU). 'auto': as PPOTrainer "
        "chooses for 'auto' (8 bits, else 4, under --config aggressive only and only where the plan pays; "
        "said in the table's 'frozen models' row).",
    )
    p.add_argument(
        "--host-offload",
        choices=("auto", "on", "off"),
        default=None,
        help="PPOConfig's host_offload: the frozen models' weights and the optimizer state in host memory "
        "between phases (default: PPOConfig's, 'auto': where it pays; 'off': never; planned only with "
        "--gpu-memory or without a GPU).",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="PPOConfig's rollout_kv_cache_dtype: the rollout KV cache in the model's dtype ('auto', "
        "PPOConfig's default, and 'model') or 8-bit ('fp8', 'int8': about half the bytes, so the generation "
        "chunk may grow; changes the arithmetic). Said in the plan table.",
    )
    p.add_argument("--json", action="store_true", help="Print the plan as JSON instead of the table.")
    p.set_defaults(func=plan_command)
    return p


def plan_command(args: argparse.Namespace) -> int:
    """Check the flags, build the trainer, plan; print the table (or JSON). Exit 2 on a user mistake."""
    with JsonStdout(args.json) as out:  # what libraries print while planning goes to stderr
        return _plan_command(args, out)


def _plan_command(args: argparse.Namespace, out: JsonStdout) -> int:
    from rapidfire_hf.config import ConfigError

    try:
        if args.host_offload is None:  # PPOConfig's default, from its one home
            from rapidfire_hf.memory.offload_plan import HOST_OFFLOAD_DEFAULT

            args.host_offload = HOST_OFFLOAD_DEFAULT
        _check_args(args)
        if _analytic(args):
            return _card_plan_and_print(args, out)
        if args.output_dir is not None:
            return _plan_and_print(args, Path(args.output_dir), out)
        with tempfile.TemporaryDirectory(prefix="rapidfire_plan_") as tmp:
            return _plan_and_print(args, Path(tmp), out)
    except (PlanUsageError, ConfigError) as err:
        print(f"rapidfire plan: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except CannotBuild as err:
        print(f"rapidfire plan: {_one_line(err)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT


class CannotBuild(Exception):
    """The model does not fit this machine to build and probe: one line, exit status 1."""


ASSUMED_GPU_GIB = 80.0  # the card a named shape is planned for on a machine without a GPU


def _analytic(args: argparse.Namespace) -> bool:
    """Plan from the shape alone: a card was named, or a named shape on a machine without a GPU (whose
    measured plan would be for the host's RAM, not for a GPU)."""
    import torch

    if args.gpu_memory is not None:
        return True
    if torch.cuda.is_available():
        if args.reward == "model" or args.peft or args.frozen_quantization:
            raise PlanUsageError(
                "--reward model, --peft and --frozen-quantization are planned from the shape: add --gpu-memory GiB"
            )
        return False
    if args.model is None and args.shape != "smoke":
        args.gpu_memory = ASSUMED_GPU_GIB
        return True
    if args.reward == "model" or args.peft or args.frozen_quantization:
        raise PlanUsageError(
            "--reward model, --peft and --frozen-quantization are planned from the shape: add --gpu-memory GiB"
        )
    return False


def _gpu_gib(text: str) -> float:
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not 0 < gib <= MAX_GPU_GIB:  # NaN fails this too
        raise PlanUsageError(f"--gpu-memory {text!r}: expected a number of GiB above 0, e.g. 80")
    return gib


def _decoder_shape(args: argparse.Namespace):
    """``(DecoderShape, name)`` of ``--shape`` or of ``--model``'s config.json (no weights read)."""
    from rapidfire_hf.memory.estimate import DecoderShape

    if args.model is None:
        from rapidfire_hf.demo.shapes import llama_config, llama_shape

        conf = llama_config(llama_shape(args.shape), args.prompt_length + args.response_length + 8)
        return DecoderShape.from_config(conf), args.shape
    from transformers import AutoConfig

    try:
        conf = AutoConfig.from_pretrained(args.model)
        shape = DecoderShape.from_config(conf)
    except Exception as err:  # noqa: BLE001 - whatever the config's loader or validator raises: the user's file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PlanUsageError(f"--model {args.model}: no decoder shape in its config.json ({first})") from None
    if shape.windows and not _native_ring(conf):
        # the generic path keeps every layer's cache full-length: count it so (PPOTrainer's plan does too)
        shape = dataclasses.replace(shape, windows=())
    return shape, args.model


def _meta_model(conf):
    """The causal LM of ``conf`` built on the meta device (no memory, no weights read), or None where
    transformers cannot build it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(conf)
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build
        return None


def _kv_model_reason(args: argparse.Namespace) -> str | None:
    """Why the policy's decode would not read an 8-bit KV cache (``rollout.engine.eight_bit_cache_reason``),
    for the KV-cache choice: None for a named shape (a Llama); ``--model``: judged on its meta-device model."""
    if args.model is None:
        return None
    from transformers import AutoConfig

    from rapidfire_hf.rollout.engine import eight_bit_cache_reason

    model = _meta_model(AutoConfig.from_pretrained(args.model))  # read by _decoder_shape already
    if model is None:
        return "transformers cannot build the model to check its decode path"
    return eight_bit_cache_reason(model)


def _native_ring(conf) -> bool:
    """Whether the static engine's native path, which keeps a local layer's cache as a ring of its window,
    runs the model of ``conf``: judged on the model built on the meta device (no memory, no weights read).
    A model that cannot be built that way is planned with full-length caches (the larger estimate)."""
    from rapidfire_hf.rollout.llama_forward import ring_windows

    model = _meta_model(conf)
    return model is not None and bool(ring_windows(model))


def _card_plan_and_print(args: argparse.Namespace, out: JsonStdout) -> int:
    """The plan for a card of ``--gpu-memory`` GiB from the shape alone (module docstring)."""
    from rapidfire_hf.config import load_config
    from rapidfire_hf.config.schema import to_plain
    from rapidfire_hf.memory.card_plan import RunShape, card_plan, fit_hint
    from rapidfire_hf.memory.frozen_choice import AUTO, plan_frozen
    from rapidfire_hf.memory.kv_choice import AUTO as KV_AUTO
    from rapidfire_hf.memory.kv_choice import plan_kv_cache, run_with_kv_choice
    from rapidfire_hf.memory.planner import GIB, Asked

    gib = _gpu_gib(str(args.gpu_memory))
    shape, name = _decoder_shape(args)
    level = to_plain(load_config(args.config).memory.optimization)
    run = RunShape(
        shape,
        rollout_rows=args.batch,
        micro_rows=args.micro,
        prompt_tokens=args.prompt_length,
        response_tokens=args.response_length,
        mini_batches=args.mini_batches,
        value_mode=args.value_mode or ("separate" if args.model is None else "fused"),
        peft=args.peft,
        reward_model=args.reward == "model",
        kv_cache_dtype=_engine_kv_cache(args),
    )
    auto = args.frozen_quantization == AUTO
    if args.frozen_quantization is not None and not auto:
        run = run.with_frozen(args.frozen_quantization)
    asked = Asked(
        scoring_rows=None if args.score_chunk == "auto" else args.score_chunk,
        generation_rows=None if args.generation_chunk == "auto" else args.generation_chunk,
        free_cache=True,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    device = int(gib * GIB)
    choice = None
    # why the policy's decode would not read an 8-bit cache: asked once (it builds the model on the meta device)
    kv_reason = _kv_model_reason(args) if args.kv_cache_dtype == KV_AUTO else None
    if auto:  # PPOTrainer's own choice for "auto" (memory.frozen_choice), then the plan of what it chose
        frozen_run = run
        if args.kv_cache_dtype == KV_AUTO:  # planned with the cache "auto" chooses, as PPOTrainer does
            frozen_run = run_with_kv_choice(run, device, level, kv_reason, asked=asked,
                                            host_offload=args.host_offload)  # fmt: skip
        choice = plan_frozen(frozen_run, device, level, asked=asked, host_offload=args.host_offload)
        run = run.with_frozen(choice.bits) if choice.bits else run
    label = f"{name}, bf16"
    if args.kv_cache_dtype == KV_AUTO:  # PPOTrainer's own choice for "auto" (memory.kv_choice)
        kv, plan = plan_kv_cache(run, device, level, kv_reason, asked=asked, label=label,
                                 host_offload=args.host_offload)  # fmt: skip
        run = dataclasses.replace(run, kv_cache_dtype=kv.dtype)
    else:
        plan = card_plan(run, device, level, asked=asked, label=label, host_offload=args.host_offload)
    if choice is not None:
        plan = choice.on(plan)
    mem = run.memory(eight_bit_state=plan.optimizer_state == "8-bit")
    if args.json:
        out.emit(
            {
                **plan.to_dict(),
                "gpu_memory_gib": gib,
                "held_gib": {
                    "weights": round(mem.weights / GIB, 3),
                    "gradients": round(mem.gradients / GIB, 3),
                    "optimizer_state": round(mem.state / GIB, 3),
                },
            }
        )
    else:
        print(
            f"policy {name} ({shape.params() / 1e6:,.1f}M parameters, bf16, {run.value_mode} value"
            f"{', LoRA' if run.peft else ''}, {args.reward} reward) planned for a {gib:g} GiB card from its "
            f"shape; rollout batch {args.batch}, num_mini_batches {args.mini_batches}, micro-batch "
            f"{args.micro}; {args.prompt_length} + {args.response_length} tokens; held: weights "
            f"{mem.weights / GIB:.1f} GiB, gradients {mem.gradients / GIB:.1f} (training only), optimizer "
            f"state {mem.state / GIB:.1f}",
            flush=True,
        )
        print(plan.table(), flush=True)
    if plan.fits:
        return 0
    hint = fit_hint(run, device, level, asked=asked, host_offload=args.host_offload)
    print(
        f"rapidfire plan: does not fit: planned peak {plan.planned_peak_bytes / GIB:.1f} GiB of the "
        f"{plan.target_bytes / GIB:.1f} GiB target on a {gib:g} GiB card; {hint}",
        file=sys.stderr,
    )
    return EXIT_DOES_NOT_FIT


def _engine_kv_cache(args: argparse.Namespace) -> str | None:
    """The rollout engine's ``kv_cache_dtype`` for ``--kv-cache-dtype`` (None: the model's dtype)."""
    from rapidfire_hf.ppo.config import engine_kv_cache_dtype

    return engine_kv_cache_dtype(args.kv_cache_dtype)


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
    if args.gpu_memory is not None:
        _gpu_gib(args.gpu_memory)
    args.score_chunk = _chunk("--score-chunk", args.score_chunk)
    from rapidfire_hf.ppo.config import KV_CACHE_CHOICES, KV_CACHE_DEFAULT

    if args.kv_cache_dtype is None:  # PPOConfig's default, from its one home
        args.kv_cache_dtype = KV_CACHE_DEFAULT
    if args.kv_cache_dtype not in KV_CACHE_CHOICES:
        allowed = ", ".join(repr(c) for c in KV_CACHE_CHOICES)
        raise PlanUsageError(f"--kv-cache-dtype {args.kv_cache_dtype!r}: expected one of {allowed}")
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


def _plan_and_print(args: argparse.Namespace, out_dir: Path, out: JsonStdout) -> int:
    from rapidfire_hf.memory.planner import GIB

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink) if args.json else contextlib.nullcontext():
        with _out_of_memory_said(args):
            trainer, about = _build_trainer(args, out_dir)
            if not args.json:
                print(about, flush=True)
            plan = plan_for(trainer, args.prompt_length)  # prints the table on the main process
    if args.json:
        out.emit(plan.to_dict())
    if plan.fits or not plan.planned:
        return 0
    print(
        f"rapidfire plan: does not fit: planned peak {plan.planned_peak_bytes / GIB:.1f} GiB of the "
        f"{plan.target_bytes / GIB:.1f} GiB target on this device; {_measured_hint(args, plan.level)}",
        file=sys.stderr,
    )
    return EXIT_DOES_NOT_FIT


def _measured_hint(args: argparse.Namespace, level: str) -> str:
    """What would make a measured plan fit: the smallest card the shape fits (planned from the shape), else
    the settings that lower memory."""
    from rapidfire_hf.memory.card_plan import RunShape, smallest_card
    from rapidfire_hf.memory.planner import Asked

    generic = "a smaller --batch, a shorter --response-length, or --config aggressive"
    try:
        shape, _ = _decoder_shape(args)
    except PlanUsageError:
        return "fits with " + generic
    run = RunShape(shape, args.batch, args.micro, args.prompt_length, args.response_length,
                   mini_batches=args.mini_batches,
                   value_mode=args.value_mode or ("separate" if args.model is None else "fused"),
                   kv_cache_dtype=_engine_kv_cache(args))  # fmt: skip
    card = smallest_card(run, level, asked=Asked(free_cache=True))
    return (
        f"fits with a GPU of at least {card} GiB (planned from the shape), or {generic}"
        if card
        else ("fits with " + generic)
    )


@contextlib.contextmanager
def _out_of_memory_said(args: argparse.Namespace):
    """An allocator error while building or probing the models is the machine's limit, not a bug: one line
    naming it and the way around it (plan for a card from the shape: nothing is allocated)."""
    import torch

    try:
        yield
    except (MemoryError, torch.OutOfMemoryError, RuntimeError) as err:
        text = str(err)
        allocator = isinstance(err, (MemoryError, torch.OutOfMemoryError)) or any(
            s in text.lower() for s in ("out of memory", "can't allocate", "cannot allocate", "alloc")
        )
        if not allocator:
            raise
        first = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
        what = args.shape or args.model
        raise CannotBuild(
            f"{what} does not fit this machine to build and probe ({type(err).__name__}: {first}); plan it "
            "for a card from its shape with --gpu-memory GiB (nothing is allocated)"
        ) from None


def plan_for(trainer, prompt_length: int):
    """``trainer.plan_update`` (``ppo/planning.plan_run``) on the trainer's first prompt batch, left-padded
    or cut to ``prompt_length`` tokens."""
    import torch

    ids = trainer.next_prompts(0)["input_ids"]
    if ids.shape[1] >= prompt_length:
        ids = ids[:, -prompt_length:]  # keep the end: the prompts are left-padded
    else:
        pad = torch.full((ids.shape[0], prompt_length - ids.shape[1]), trainer.pad_token_id, dtype=ids.dtype)
        ids = torch.cat([pad, ids], dim=1)
    return trainer.plan_update(ids.to(trainer.accelerator.device))


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
        rollout_kv_cache_dtype=args.kv_cache_dtype,  # refused by name where the rollout cannot keep it
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
