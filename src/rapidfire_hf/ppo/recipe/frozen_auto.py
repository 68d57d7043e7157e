"""PPOTrainer's ``ref_model_quantization`` / ``reward_model_quantization="auto"``: the run as a
:class:`~rapidfire_hf.memory.card_plan.RunShape` and the choice of :func:`rapidfire_hf.memory.frozen_choice.
plan_frozen` for the card it runs on, made at construction (the frozen models are copied or quantized then).

The run planned is the one ``rapidfire plan --frozen-quantization auto`` plans from the same settings: the
policy's shape, the rollout, mini- and micro-batches, the tokens of a row (``max_prompt_length``, else the
longest prompt, plus ``response_length``), the value mode, LoRA, a reward model of the policy's shape, bf16
on a CUDA GPU with the static engine where it can run the policy."""

from __future__ import annotations

from dataclasses import replace

import torch

from rapidfire_hf.memory.card_plan import LORA_TARGETS, RunShape
from rapidfire_hf.memory.estimate import DecoderShape
from rapidfire_hf.memory.frozen_choice import AUTO, FrozenChoice, choose_frozen, plan_frozen
from rapidfire_hf.memory.kv_choice import AUTO as KV_AUTO
from rapidfire_hf.memory.kv_choice import run_with_kv_choice
from rapidfire_hf.memory.planner import Asked, level_target
from rapidfire_hf.ppo.config import engine_kv_cache_dtype
from rapidfire_hf.utils.device_memory import device_capacity_bytes
from rapidfire_hf.utils.imports import is_available


def card_bytes(device) -> int | None:
    """The card the plan is for: the CUDA device's capacity; None elsewhere (no card to plan for)."""
    device = torch.device(device)
    return device_capacity_bytes(device) if device.type == "cuda" else None


def _lora(policy) -> tuple[int, tuple[str, ...]]:
    config = next(iter(getattr(policy, "peft_config", {}).values()), None)
    targets = getattr(config, "target_modules", None)
    targets = tuple(sorted(targets)) if isinstance(targets, (set, list, tuple)) and targets else LORA_TARGETS
    return int(getattr(config, "r", 16) or 16), targets


def _static_engine(args, policy) -> bool:
    from rapidfire_hf.rollout.engine import choose_decode_path

    if args.rollout_backend != "auto":
        return args.rollout_backend == "static"
    return choose_decode_path(policy)[0] is not None


def prompt_tokens(args, train_dataset) -> int:
    """Prompt tokens per row the plan assumes: ``max_prompt_length``, else the longest prompt."""
    if args.max_prompt_length:
        return int(args.max_prompt_length)
    return max((len(ids) for ids in train_dataset["input_ids"]), default=1)


def trainer_run_shape(args, policy, reward_model, is_peft: bool, prompts: int, itemsize: int = 2) -> RunShape:
    """The :class:`RunShape` of a PPOTrainer run of ``args`` on ``policy`` (module docstring)."""
    rank, targets = _lora(policy) if is_peft else (16, LORA_TARGETS)
    return RunShape(
        DecoderShape.from_config(policy.config),
        rollout_rows=args.local_batch_size,
        micro_rows=args.per_device_train_batch_size,
        prompt_tokens=prompts,
        response_tokens=args.response_length,
        mini_batches=args.num_mini_batches,
        value_mode=args.value_mode,
        peft=is_peft,
        lora_rank=rank,
        lora_targets=targets,
        reward_model=reward_model is not None,
        itemsize=itemsize,
        static_engine=_static_engine(args, policy),
        ref_quantization=None if args.ref_model_quantization == AUTO else args.ref_model_quantization,
        reward_quantization=None
        if args.reward_model_quantization == AUTO
        else args.reward_model_quantization,
        kv_cache_dtype=engine_kv_cache_dtype(args.rollout_kv_cache_dtype),
    )


def decide_frozen(
    args, memory, policy, reward_model, is_peft: bool, device, train_dataset
) -> FrozenChoice | None:
    """What ``"auto"`` holds the frozen models in on ``device`` (None: neither field asks ``"auto"``).

    Args:
        memory: the rapidfire config's ``MemoryConfig`` (None: no config, nothing planned).
        train_dataset: the tokenized prompts (their longest is read only where a plan is made).
    """
    ref_auto, reward_auto = args.ref_model_quantization == AUTO, args.reward_model_quantization == AUTO
    if not (ref_auto or reward_auto):
        return None
    level = memory.optimization if memory is not None else None
    has = bool((ref_auto and not is_peft) or (reward_auto and reward_model is not None))
    if not has or level is None or not level_target(level).frozen_quantization:
        return choose_frozen(level, None, {}, has_frozen=has)  # said without a plan
    card = card_bytes(device)
    if card is None:
        return FrozenChoice(None, f"auto: no GPU to plan for (this run is on {torch.device(device).type})")
    try:
        run = trainer_run_shape(args, policy, reward_model, is_peft, prompt_tokens(args, train_dataset))
    except (AttributeError, TypeError) as err:  # not a decoder config the planner reads
        return FrozenChoice(None, f"auto: the planner cannot read {type(policy).__name__}'s shape ({err})")
    from rapidfire_hf.ppo.recipe.planning import asked

    card_kwargs = {
        "asked": _card_asked(asked(args, memory, deepspeed=False)),
        "eight_bit_available": is_available("bitsandbytes"),
        "fuse_projections": args.rollout_decode_fuse_projections,
        "host_offload": args.host_offload,
    }
    if args.rollout_kv_cache_dtype == KV_AUTO:  # the cache "auto" will choose, decided first (kv_choice)
        from rapidfire_hf.rollout.engine import eight_bit_cache_reason

        reason = eight_bit_cache_reason(policy) if run.static_engine else None  # as planning.kv_auto_unable
        run = run_with_kv_choice(run, card, level, reason, **card_kwargs)
    return plan_frozen(run, card or 0, level, ref_auto=ref_auto, reward_auto=reward_auto, **card_kwargs)


# the analytic probe knows the selective policies: HF's own checkpointing (everything recomputed) plans as the
# most recompute it knows, memory.checkpointing=off as none
_CARD_POLICY = {"gradient_checkpointing": "matmuls", "off": "none"}


def _card_asked(want: Asked) -> Asked:
    return replace(want, checkpointing=_CARD_POLICY.get(want.checkpointing, want.checkpointing))


def resolved_bits(args, choice: FrozenChoice | None, is_peft: bool, has_reward_model: bool) -> tuple:
    """``(reference, reward)`` bits: each field's own value, ``"auto"`` replaced by the choice where that
    model exists separately (LoRA's reference is the adapter-disabled policy; a rule has no reward model)."""
    bits = choice.bits if choice is not None else None
    ref = args.ref_model_quantization
    reward = args.reward_model_quantization
    return (
        (None if is_peft else bits) if ref == AUTO else ref,
        (bits if has_reward_model else None) if reward == AUTO else reward,
    )


def after_new_config(choice: FrozenChoice | None, args, memory, policy, reward_model, is_peft: bool, device,
                     train_dataset) -> FrozenChoice | None:  # fmt: skip
    """The choice to report once a rapidfire config is applied to a built trainer (``enable_rapidfire``): the
    frozen models were built with the trainer and stay as they are, so where the new config's plan would
    choose otherwise, that is said instead of the new reason (None: no ``"auto"`` field)."""
    if choice is None:
        return None
    new = decide_frozen(args, memory, policy, reward_model, is_peft, device, train_dataset)
    if new is None or new.bits == choice.bits:
        return new
    return FrozenChoice(
        choice.bits,
        f"{choice.reason}; kept: the frozen models were built with the trainer, before this rapidfire config, "
        f"whose plan would choose {new.label} (give the config as PPOConfig(rapidfire_config=...) to plan them)",
    )
