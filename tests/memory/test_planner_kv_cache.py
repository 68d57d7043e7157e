"""The planner's KV-cache term in the cache's dtype (``PPOConfig.rollout_kv_cache_dtype``): an 8-bit cache
holds one byte an element plus one fp32 scale per head vector, so at the 7B shape on an 80 GB card the
generation chunk grows and the generation peak of a fixed chunk drops by what that arithmetic gives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rapidfire_hf.demo.shapes import llama_config, llama_shape
from rapidfire_hf.memory.card_plan import RunShape, card_plan
from rapidfire_hf.memory.estimate import DecoderShape
from rapidfire_hf.memory.planner import GIB, Asked, kv_bytes_per_token

PROMPT, RESPONSE = 128, 384
CONFIG = llama_config(llama_shape("llama-7b"), PROMPT + RESPONSE + 8)
SHAPE = DecoderShape.from_config(CONFIG)
# the run: 7B full fine-tuning, fused value head, batch 160 in micro-batches of 8, on an 80 GB card
RUN = RunShape(SHAPE, rollout_rows=160, micro_rows=8, prompt_tokens=PROMPT, response_tokens=RESPONSE)
CARD = 80 * GIB
OFF = {"host_offload": "off"}  # PPOConfig's default
# Llama-7B: 32 layers of 32 K/V heads of width 128; K and V per token of a row
LAYERS, KV_HEADS, D = 32, 32, 128
BF16_PER_TOKEN = 2 * LAYERS * KV_HEADS * D * 2  # 512 KiB
EIGHT_BIT_PER_TOKEN = 2 * LAYERS * KV_HEADS * (D + 4)  # one byte an element + a 4-byte scale per vector


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_the_cache_bytes_per_token_follow_the_cache_dtype(kv):
    assert kv_bytes_per_token(CONFIG, 2) == SHAPE.kv_bytes_per_token(2) == BF16_PER_TOKEN
    assert kv_bytes_per_token(CONFIG, 2, kv) == SHAPE.kv_bytes_per_token(2, kv) == EIGHT_BIT_PER_TOKEN
    assert EIGHT_BIT_PER_TOKEN / BF16_PER_TOKEN == pytest.approx(0.516, abs=1e-3)  # (128 + 4) / 256
    work = replace(RUN, kv_cache_dtype=kv).workload()
    assert work.kv_bytes_per_token == EIGHT_BIT_PER_TOKEN and work.kv_cache_dtype == kv


def test_an_8bit_cache_generates_the_7b_batch_in_one_chunk_on_an_80gb_card():
    plans = {
        kv: card_plan(replace(RUN, kv_cache_dtype=kv), CARD, "aggressive", **OFF) for kv in (None, "int8")
    }
    full, small = plans[None], plans["int8"]
    assert full.fits and small.fits
    # the model's dtype: 160 prompts in 2 chunks of 80; int8: the whole batch at once
    assert (full.generation_rows, small.generation_rows) == (80, 160)
    # the rest of the plan is the same run
    assert (full.train_rows, full.checkpointing, full.scoring_rows) == (
        small.train_rows, small.checkpointing, small.scoring_rows
    )  # fmt: skip
    assert (full.kv_cache_dtype, small.kv_cache_dtype) == ("model dtype", "int8")
    assert "KV cache dtype" in small.table() and "264.0 KiB a token of a row" in small.table()


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_the_generation_peak_of_a_fixed_chunk_drops_by_the_caches_bytes(kv):
    rows = 80  # the chunk fixed (rollout_generation_batch_size=80): only the cache's bytes differ
    asked = Asked(generation_rows=rows, free_cache=True)
    full = card_plan(RUN, CARD, "aggressive", asked=asked, **OFF)
    small = card_plan(replace(RUN, kv_cache_dtype=kv), CARD, "aggressive", asked=asked, **OFF)
    tokens = PROMPT + RESPONSE
    drop = full.phase_peak_bytes["generation"] - small.phase_peak_bytes["generation"]
    assert drop == rows * tokens * (BF16_PER_TOKEN - EIGHT_BIT_PER_TOKEN)  # 9.69 GiB
    # what a generated row costs the plan falls by the ratio the cache's bytes give (the prefill's working set
    # and one step's fp32 logits stay)
    other = PROMPT * 16 * SHAPE.hidden * 2 + 2 * SHAPE.vocab * 4
    ratio = (tokens * EIGHT_BIT_PER_TOKEN + other) / (tokens * BF16_PER_TOKEN + other)
    peak_full, peak_small = full.phase_peak_bytes["generation"], small.phase_peak_bytes["generation"]
    held = peak_full - rows * (tokens * BF16_PER_TOKEN + other)  # weights and state the phase holds
    assert (peak_small - held) / (peak_full - held) == pytest.approx(ratio, rel=1e-12)
    assert ratio == pytest.approx(0.545, abs=1e-3)


def test_the_asked_value_is_what_the_table_says():
    plan = card_plan(RUN, CARD, "aggressive", asked=Asked(free_cache=True, kv_cache_dtype="model"))
    assert plan.asked["kv_cache_dtype"] == "model" and plan.kv_cache_dtype == "model dtype"
    assert "'auto': int8 only where" not in plan.reasons["kv_cache_dtype"]
    auto = card_plan(RUN, CARD, "aggressive")
    assert (
        auto.asked["kv_cache_dtype"] == "auto"
        and "'auto': int8 only where memory.optimization=aggressive" in auto.reasons["kv_cache_dtype"]
    )


def test_a_local_layers_cache_counts_its_window_not_the_rollout():
    """Gemma-3-1B's shape (26 layers, every sixth global, window 512, one K/V head of width 256): past the
    window its 22 local layers hold 512 slots each (the static engine's ring), the 4 global ones the whole
    rollout; within the window every layer holds the rollout."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        num_hidden_layers=26, hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
    )  # fmt: skip
    shape = DecoderShape.from_config(cfg)
    assert shape.windows.count(512) == 22 and shape.windows.count(None) == 4
    per_layer_token = 2 * 1 * 256 * 2  # K and V, one head of 256, bf16
    long = RunShape(shape, rollout_rows=8, micro_rows=8, prompt_tokens=128, response_tokens=1024).workload()
    assert long.kv_bytes_per_token == 26 * per_layer_token
    assert long.cache_row_bytes() == per_layer_token * (4 * 1152 + 22 * 512)
    assert long.held_cache_bytes(8) == 8 * long.cache_row_bytes()  # the static engine keeps it
    cache = long.cache_row_bytes()
    assert long.generation_row_bytes() - cache == replace(long, kv_windows=()).generation_row_bytes() - (
        1152 * long.kv_bytes_per_token
    )  # the rest of a generated row is unchanged
    short = RunShape(shape, rollout_rows=8, micro_rows=8, prompt_tokens=128, response_tokens=256).workload()
    assert short.cache_row_bytes() == 384 * short.kv_bytes_per_token
    with pytest.raises(ValueError, match="kv_windows has 3 entries for 26 layers"):
        replace(long, kv_windows=(512, None, 512))
