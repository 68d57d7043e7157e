"""benchmarks/grpo/memory_model.py: the GRPO step's memory estimated from the model's shapes (meta tensors),
per stack of memory mechanisms."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loader import BENCHMARKS, load_benchmark


def load(name: str):
    if str(BENCHMARKS / "grpo") not in sys.path:
        sys.path.insert(0, str(BENCHMARKS / "grpo"))
    return load_benchmark(f"grpo/{name}.py", keep_on_path=True)


def test_memory_model_orders_the_variants(single_thread):
    mm = load("memory_model")
    shape = dict(
        hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512,
        prompt_len=16, completion_len=16, batch=16,
    )  # fmt: skip
    est = {v: mm.estimate(v, shape, rows=4, lm_head_chunk=256) for v in mm.VARIANTS}
    params = sum(p.numel() for p in mm.build_meta_model(shape).parameters())
    assert est["stock"]["static_gib"]["weights"] == pytest.approx(2 * params / mm.GIB)
    assert est["stock"]["static_gib"]["optimizer_state"] == pytest.approx(4 * params / mm.GIB)
    assert (
        est["rapidfire_lowmem"]["static_gib"]["optimizer_state"]
        < est["stock"]["static_gib"]["optimizer_state"]
    )
    # stock and lowmem keep every gradient after backward; lowmem2's pipeline frees them
    assert est["stock"]["gradients_left_after_backward_gib"] == pytest.approx(2 * params / mm.GIB)
    assert est["rapidfire_lowmem2"]["gradients_left_after_backward_gib"] == 0
    back = {v: e["dynamic_peak_gib"]["backward"] for v, e in est.items()}
    assert back["rapidfire_lowmem2"] < back["rapidfire_lowmem"] == pytest.approx(back["stock"])
    padded = mm.estimate("stock", shape, rows=4, lm_head_chunk=256, padded=True)
    assert padded["dynamic_peak_gib"]["backward"] > back["stock"]  # k/v repeated to all heads


def test_memory_model_lowmem3_state_and_prefill(single_thread):
    mm = load("memory_model")
    shape = dict(
        hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=4096,
        prompt_len=16, completion_len=16, batch=16,
    )  # fmt: skip
    small = dict(rows=4, forward_rows=8, prefill_rows=4)
    v2 = mm.estimate("rapidfire_lowmem2", shape, rows=4, lm_head_chunk=256)
    v3 = mm.estimate("rapidfire_lowmem3", shape, rows=4, lm_head_chunk=256, lowmem3=small)
    # the embedding's state in 8 bits: 6 bytes a parameter less than transformers' 32-bit override
    emb = shape["vocab"] * shape["hidden"]
    saved = v2["static_gib"]["optimizer_state"] - v3["static_gib"]["optimizer_state"]
    assert saved == pytest.approx((6 * emb - 8 * -(-emb // 256)) / mm.GIB)
    assert v3["generation_gib"]["prefill_transient"] == pytest.approx(
        v2["generation_gib"]["prefill_transient"] / 4
    )
    assert v3["gradients_left_after_backward_gib"] == 0 and v3["chunking"] == small
    # the same backward chunk as lowmem2's (4 rows): wider forward chunks do not raise the backward peak
    assert 0 < v3["dynamic_peak_gib"]["backward"] <= v2["dynamic_peak_gib"]["backward"]
