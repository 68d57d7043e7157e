"""memory.kv_choice: what ``rollout_kv_cache_dtype="auto"`` stores the rollout KV cache in, from two plans.

The shapes here are the GPU rows': the 7B LoRA batch-256 run on one H100 80 GB generated in 2 chunks of 128
with the bf16 cache and in one of 256 with int8 (benchmarks/card80/results/h100_2026-12-07c/lora7b_kv:
3,719 vs 4,084 tokens/s), and the plan from the shape alone must make the same choice."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rapidfire_hf.memory.card_plan import RunShape, card_plan
from rapidfire_hf.memory.estimate import DecoderShape
from rapidfire_hf.memory.kv_choice import (
    KVChoice,
    cache_unable,
    choose_kv_cache,
    generation_chunks,
    plan_kv_cache,
    run_with_kv_choice,
)
from rapidfire_hf.memory.planner import GIB

ROOT = Path(__file__).resolve().parents[2]
H100 = int(79.19 * GIB)  # what an H100 80GB reports


def _shape(name: str) -> DecoderShape:
    """``rapidfire plan --shape NAME``'s shape (demo.shapes)."""
    from rapidfire_hf.demo.shapes import llama_config, llama_shape

    return DecoderShape.from_config(llama_config(llama_shape(name), 520))


LLAMA_7B = _shape("llama-7b")
LORA_256 = RunShape(LLAMA_7B, rollout_rows=256, micro_rows=8, prompt_tokens=128, response_tokens=384,
                    value_mode="fused", peft=True, reward_model=True)  # fmt: skip


def test_the_lora_7b_batch_256_row_takes_int8_as_the_gpu_run_measured():
    choice, plan = plan_kv_cache(LORA_256, H100, "aggressive")
    assert choice.dtype == "int8" and plan.kv_cache_dtype == "int8" and plan.fits
    assert choice.reason.startswith("auto, aggressive: generation in 1 chunk of 256 rows, not 2 of 128")
    given = card_plan(LORA_256, H100, "aggressive")
    # every other choice is the bf16 plan's: the cache is all that changed
    for key in ("train_rows", "checkpointing", "splits", "scoring_rows", "optimizer_state", "offload_frozen"):
        assert getattr(plan, key) == getattr(given, key), key
    # the GPU rows ran these plans: bf16 2 chunks of 128, int8 one of 256, 0 OOM splits, int8 faster
    rows = json.loads(
        (ROOT / "benchmarks/card80/results/h100_2026-12-07c/lora7b_kv/results.json").read_text()
    )
    ran = {r["row"]: r for r in rows["rows"]}
    assert ran["lora7b_offload"]["plan"]["generation_rows"] == given.generation_rows == 128
    assert ran["lora7b_int8kv"]["plan"]["generation_rows"] == plan.generation_rows == 256
    assert ran["lora7b_int8kv"]["tokens_per_s"] > ran["lora7b_offload"]["tokens_per_s"]


@pytest.mark.parametrize(
    ("run", "level", "why"),
    [
        # the README's headline shape: one chunk either way
        (
            replace(LORA_256, shape=_shape("llama-1.1b"), rollout_rows=8, peft=False, reward_model=False),
            "aggressive",
            "8 bits would generate in the same 1 chunk",
        ),  # fmt: skip
        (LORA_256, "balanced", "memory.optimization=balanced keeps the arithmetic"),
        (LORA_256, "conservative", "memory.optimization=conservative keeps the arithmetic"),
        (LORA_256, "auto", "memory.optimization=auto keeps the arithmetic"),
        (replace(LORA_256, static_engine=False), "aggressive", "the rollout runs model.generate"),
    ],
)
def test_auto_keeps_the_models_dtype_where_8_bits_would_not_pay_or_are_not_allowed(run, level, why):
    choice, plan = plan_kv_cache(run, H100, level)
    assert choice.dtype is None and plan.kv_cache_dtype == "model dtype"
    assert why in choice.reason and plan.reasons["kv_cache_dtype"] == choice.reason
    assert plan.asked["kv_cache_dtype"] == "auto"


def _plans(**eight):
    given = card_plan(LORA_256, H100, "aggressive")
    return given, replace(card_plan(replace(LORA_256, kv_cache_dtype="int8"), H100, "aggressive"), **eight)


def test_fewer_chunks_do_not_pay_for_an_added_trade():
    given, eight = _plans(checkpointing="matmuls")  # the 8-bit plan recomputing where bf16 does not
    assert given.checkpointing == "none" and generation_chunks(eight, 256) < generation_chunks(given, 256)
    choice = choose_kv_cache("aggressive", given, eight, 256)
    assert choice.dtype is None and "add a trade" in choice.reason


def test_a_plan_that_does_not_fit_takes_the_8bit_one_that_does_whatever_it_trades():
    given, eight = _plans(checkpointing="matmuls")
    choice = choose_kv_cache("aggressive", replace(given, fits=False), eight, 256)
    assert choice.dtype == "int8" and "does not fit the card" in choice.reason
    none = choose_kv_cache("aggressive", replace(given, fits=False), replace(eight, fits=False), 256)
    assert none.dtype is None and "would not fit either" in none.reason


def test_the_same_chunks_keep_the_models_dtype():
    given, eight = _plans(generation_rows=128)
    assert choose_kv_cache("aggressive", given, eight, 256).reason.endswith("the same 2 chunks)")


def test_what_stops_an_8bit_cache_is_named():
    assert cache_unable(True, True) is None
    assert cache_unable(True, False) == "not a CUDA GPU"
    assert cache_unable(False, True) == "the rollout runs model.generate"
    assert cache_unable(True, True, "the model's reason") == "the model's reason"
    choice = choose_kv_cache("aggressive", None, None, 8, "not a CUDA GPU")
    assert choice == KVChoice(None, "auto: the model's dtype (not a CUDA GPU)")
    assert choose_kv_cache(None, None, None, 8).dtype is None
    with pytest.raises(ValueError, match="needs the plans"):
        choose_kv_cache("aggressive", None, None, 8)


def test_chunks_count_the_last_short_one():
    given = card_plan(LORA_256, H100, "aggressive")
    assert [
        generation_chunks(replace(given, generation_rows=r), 256) for r in (256, 255, 128, 100, 1, 0)
    ] == [1, 2, 2, 3, 256, 1]


def test_a_trade_avoided_at_the_same_chunks_is_not_what_was_measured():
    """Only fewer generation chunks were measured to pay: an 8-bit plan that spares recompute at the same chunks
    keeps the model's dtype."""
    given, eight = _plans(generation_rows=128)
    given = replace(given, checkpointing="elementwise")
    assert eight.checkpointing == "none"
    choice = choose_kv_cache("aggressive", given, eight, 256)
    assert choice.dtype is None and choice.reason.endswith("the same 2 chunks)")


def test_the_frozen_models_auto_precision_is_planned_with_the_cache_auto_chooses():
    """7B LoRA, batch 320, a 48 GiB card: "auto" takes int8 (2 generation chunks, not 3), and the frozen
    models' "auto" precision planned with that cache quantizes the reward model (8 bits spare the host offload
    of the frozen weights at the same chunks), which the plan with the bf16 cache, a run that does not happen,
    judged needless (it would cost a generation chunk there). A cache the user names is kept as named."""
    from rapidfire_hf.memory.frozen_choice import plan_frozen

    run = replace(LORA_256, rollout_rows=320)
    card = 48 * GIB
    chosen = run_with_kv_choice(run, card, "aggressive")
    assert chosen == replace(run, kv_cache_dtype="int8")
    assert plan_frozen(run, card, "aggressive").bits is None
    frozen = plan_frozen(chosen, card, "aggressive")
    assert frozen.bits == "8bit" and "host offload" in frozen.reason, frozen
    named = replace(run, kv_cache_dtype="fp8")
    assert run_with_kv_choice(named, card, "aggressive") is named
    assert run_with_kv_choice(run, card, "balanced") == run  # the level keeps the model's dtype
