"""The rollout KV cache's elements for PPOConfig's ``rollout_kv_cache_dtype="auto"`` (its default).

An 8-bit cache (int8 elements, one fp32 scale per row, K/V head and token: 0.516x the bytes of bf16 at head
width 128) changes the arithmetic of generation: the sampled tokens may differ from a cache in the model's
dtype. So ``"auto"`` stores it in 8 bits only where the level allows arithmetic changes
(``memory.optimization=aggressive``, :data:`rapidfire_hf.memory.levels.MEMORY_LEVELS`) and only where the
plan pays for it: the smaller cache lets the rollout batch generate in fewer chunks (or lets a plan fit that
does not fit in the model's dtype), and the 8-bit plan makes no trade the other does not (recompute, pieces,
smaller scoring chunks, host offload, 8-bit optimizer state). A bigger chunk is what pays: one H100 80 GB,
7B decode step, compiled (benchmarks/rollout/results/h100/call_2026-12-07c/kv_fix): bf16 batch 128 13.43 ms,
int8 batch 128 12.49 ms, int8 batch 256 19.86 ms (1.35x per token over bf16 at 128); PPO 7B LoRA batch 256,
128 + 384 tokens, ``aggressive``, same call (benchmarks/card80/results/h100_2026-12-07c/lora7b_kv): bf16 in 2
generation chunks of 128 3,719 tokens/s, int8 in one chunk of 256 4,084 (generation 13.1 -> 9.9 s). Where the
chunks stay the same the cache keeps the model's dtype (the per-token gain at the same batch, 1.08x, was
measured at 7B batch 128 only).

Int8, not fp8: int8 is the format measured; ``"fp8"`` stays the user's to ask. The choice needs the static
engine's native decode path on a CUDA GPU with an attention that reads the 8-bit cache in its kernel (a
soft-capped attention dequantizes every slot it reads first: not measured). Plans are compared, never
guessed: :func:`choose_kv_cache` is a pure function of two plans; :func:`plan_kv_cache` makes them with
:func:`rapidfire_hf.memory.card_plan.card_plan` (``rapidfire plan --kv-cache-dtype auto``); PPOTrainer
makes them with its measured probe (``ppo/recipe/planning.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.card_plan import RunShape, card_plan
from rapidfire_hf.memory.frozen_choice import trades_avoided
from rapidfire_hf.memory.planner import Plan, level_target

AUTO = "auto"
EIGHT_BIT = "int8"  # the 8-bit format "auto" may choose (the one measured on a GPU)


@dataclass(frozen=True)
class KVChoice:
    """What ``"auto"`` chose for the rollout KV cache, and why (said once: the plan table's row).

    Attributes:
        dtype: ``"int8"`` or None (the model's dtype).
        reason: why, in a few words.
    """

    dtype: str | None
    reason: str

    def on(self, plan: Plan) -> Plan:
        """``plan`` (made with this choice's cache) with the choice's reason as its "KV cache dtype" row."""
        plan = replace(plan, reasons=dict(plan.reasons), asked=dict(plan.asked))
        plan.asked["kv_cache_dtype"] = AUTO
        plan.reasons["kv_cache_dtype"] = self.reason
        return plan


def generation_chunks(plan: Plan, rollout_rows: int) -> int:
    """How many chunks ``plan`` generates a rollout batch of ``rollout_rows`` in."""
    return math.ceil(rollout_rows / max(1, min(plan.generation_rows or rollout_rows, rollout_rows)))


def choose_kv_cache(
    level, given: Plan | None, eight_bit: Plan | None, rollout_rows: int, unable: str | None = None
) -> KVChoice:
    """The rollout KV cache's elements for ``"auto"`` (module docstring).

    Args:
        level: ``memory.optimization`` (None: no rapidfire config, no plan).
        given: the plan with the cache in the model's dtype (None where ``level`` or ``unable`` decides).
        eight_bit: the same plan with the cache in :data:`EIGHT_BIT`.
        rollout_rows: prompts per rollout batch (per device).
        unable: why this run cannot keep an 8-bit cache (None: it can).
    """
    if level is None:
        return KVChoice(None, "auto: the model's dtype (no rapidfire config, no plan)")
    name = to_plain(level)
    if not level_target(name).kv_cache_8bit:
        return KVChoice(
            None,
            f"auto: the model's dtype; memory.optimization={name} keeps the arithmetic (only aggressive may "
            "store the cache in 8 bits)",
        )
    if unable is not None:
        return KVChoice(None, f"auto: the model's dtype ({unable})")
    if given is None or eight_bit is None:
        raise ValueError("choose_kv_cache needs the plans with the cache in the model's dtype and in 8 bits")
    per_token = f"{eight_bit.kv_bytes_per_token / 1024:,.1f} KiB a token of a row"
    g, q = generation_chunks(given, rollout_rows), generation_chunks(eight_bit, rollout_rows)
    avoided = trades_avoided(given, eight_bit)
    if eight_bit.fits and (not given.fits or (avoided is not None and q < g)):
        if not given.fits:  # whatever trades the 8-bit plan makes, it fits
            why = "the plan in the model's dtype does not fit the card"
        else:
            why = (
                f"generation in {q} chunk{'s' if q > 1 else ''} of {eight_bit.generation_rows} rows, not {g} of "
                f"{given.generation_rows}"
            )
        return KVChoice(
            EIGHT_BIT,
            f"auto, {name}: {why}; {per_token} (8-bit elements, one fp32 scale per head vector; changes the "
            "arithmetic)",
        )
    if not eight_bit.fits:
        return KVChoice(None, f"auto, {name}: the model's dtype (8 bits would not fit either)")
    if avoided is None and q < g:
        return KVChoice(
            None, f"auto, {name}: the model's dtype (8 bits would take fewer chunks but add a trade)"
        )
    return KVChoice(
        None,
        f"auto, {name}: the model's dtype (8 bits would generate in the same {g} "
        f"chunk{'s' if g > 1 else ''})",
    )


def cache_unable(static_engine: bool, cuda: bool, model_reason: str | None = None) -> str | None:
    """Why a run cannot take :data:`EIGHT_BIT` for ``"auto"`` (None: it can): the static engine on a CUDA GPU,
    on a model whose decode attention reads the 8-bit cache in its kernel (``model_reason``: why not, from
    ``rapidfire_hf.rollout.engine.eight_bit_cache_reason``)."""
    if not cuda:
        return "not a CUDA GPU"
    if not static_engine:
        return "the rollout runs model.generate"
    return model_reason


def plan_kv_cache(
    run: RunShape, device_bytes: int, level, model_reason: str | None = None, **card_kwargs
) -> tuple[KVChoice, Plan]:
    """:func:`choose_kv_cache` over the plans of ``run`` (its ``kv_cache_dtype`` None) on ``device_bytes``
    (:func:`card_plan`, with ``card_kwargs``), and the plan of what it chose (the choice's reason in its
    "KV cache dtype" row). Planned for a CUDA GPU; ``model_reason``: why the model's decode would not read an
    8-bit cache (:func:`cache_unable`; None: a Llama-family shape, which does)."""
    given = card_plan(run, device_bytes, level, **card_kwargs)
    unable = cache_unable(run.static_engine, True, model_reason)
    if level is None or not level_target(level).kv_cache_8bit or unable is not None:
        choice = choose_kv_cache(level, None, None, run.rollout_rows, unable)
        return choice, choice.on(given)
    eight = card_plan(replace(run, kv_cache_dtype=EIGHT_BIT), device_bytes, level, **card_kwargs)
    choice = choose_kv_cache(level, given, eight, run.rollout_rows)
    return choice, choice.on(eight if choice.dtype else given)


def run_with_kv_choice(
    run: RunShape, device_bytes: int, level, model_reason: str | None = None, **card_kwargs
) -> RunShape:
    """``run`` with the cache ``"auto"`` chooses on its plan (:func:`plan_kv_cache`), for the frozen models'
    ``"auto"`` precision to be planned with it (``memory.frozen_choice.plan_frozen``). The 8-bit cache is
    decided first because it is the milder change: it moves only generation's sampling (scoring recomputes
    the log-probs with the model's weights and dtype), while 8- or 4-bit frozen models move the KL term
    and the score themselves; planned the other way, a plan the 8-bit cache makes fit would quantize the
    frozen models for nothing."""
    if run.kv_cache_dtype is not None:  # the user's own cache dtype
        return run
    choice, _ = plan_kv_cache(run, device_bytes, level, model_reason, **card_kwargs)
    return replace(run, kv_cache_dtype=choice.dtype) if choice.dtype else run
