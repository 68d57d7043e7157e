"""Chunked prefill (``rollout.prefill.chunk_prefill``, ``RolloutEngine(prefill_chunk_rows=...)``) against one
prefill and against ``model.generate`` (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams
from rapidfire_hf.rollout.prefill import chunk_prefill

R = 12
RTOL = 1e-5  # fp32 round-off: fewer rows per GEMM


@pytest.mark.parametrize("rows", [1, 2, 4, 8])  # 8 >= batch: one chunk
def test_chunked_prefill_samples_like_one_prefill(tokenizer, prompts, rows):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=R, temperature=1.0)

    def rollout(chunk_rows):
        engine = RolloutEngine(model, 0, [2], backend="static", prefill_chunk_rows=chunk_rows)
        assert engine.prefill_chunk_rows == chunk_rows
        return engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))

    ref, got = rollout(None), rollout(rows)
    assert torch.equal(got.responses, ref.responses)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-6)  # fp32, fewer-row GEMMs


def test_chunk_prefill_later_and_greedy_matches_generate(tokenizer, prompts):
    model = build_tiny_llama(tokenizer)
    ids, mask = prompts
    engine = RolloutEngine(model, 0, [], backend="static")
    assert engine.prefill_chunk_rows is None
    assert engine.chunk_prefill(2) is True and engine.prefill_chunk_rows == 2
    assert engine.chunk_prefill(3) is True and engine.prefill_chunk_rows == 2  # the first size stays
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=R, do_sample=False))
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, R, stop=None))


def test_hf_backend_ignores_prefill_chunks_and_bad_values_raise(tokenizer):
    model = build_tiny_llama(tokenizer)
    engine = RolloutEngine(model, 0, [], backend="hf", prefill_chunk_rows=2)
    assert engine.prefill_chunk_rows is None and engine.chunk_prefill(2) is False
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefill chunk"):
            RolloutEngine(model, 0, [], backend="static", prefill_chunk_rows=bad)
        with pytest.raises(ValueError, match="prefill chunk"):
            engine.chunk_prefill(bad)


def test_chunk_prefill_fills_the_cache_and_samples_like_one_prefill(tokenizer, single_thread):
    """The static engine (on the CPU here, eager decode) with its prefill run 3 prompts at a time: the
    same KV cache rows, the same last hidden states, the same sampled tokens as one prefill."""
    from rapidfire_hf.demo import build_tiny_llama
    from rapidfire_hf.rollout import RolloutEngine, SamplingParams

    model = build_tiny_llama(tokenizer, layers=2).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, len(tokenizer), (8, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = tokenizer.pad_token_id, 0  # a left-padded prompt
    params = SamplingParams(max_new_tokens=6, temperature=1.0)

    def rollout(rows):
        engine = RolloutEngine(model, tokenizer.pad_token_id, [], backend="static", decode_mode="eager")
        net = engine._static.net
        if rows is not None:
            chunk_prefill(net, rows)
        calls = []
        prefill = net.prefill

        def spy(input_ids, attention_mask, cos, sin, k_cache, v_cache):
            out = prefill(input_ids, attention_mask, cos, sin, k_cache, v_cache)
            calls.append((out.clone(), [k.clone() for k in k_cache], [v.clone() for v in v_cache]))
            return out

        net.prefill = spy
        out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
        return out, calls[0]

    (ref, (h0, k0, v0)), (got, (h1, k1, v1)) = rollout(None), rollout(3)
    torch.testing.assert_close(h1, h0, rtol=RTOL, atol=1e-6)
    for a, b in zip(k0 + v0, k1 + v1):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-6)
    assert torch.equal(got.responses, ref.responses)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=RTOL, atol=1e-6)
    with pytest.raises(RuntimeError, match="already"):
        engine = RolloutEngine(model, tokenizer.pad_token_id, [], backend="static", decode_mode="eager")
        chunk_prefill(engine._static.net, 2)
        chunk_prefill(engine._static.net, 2)
    with pytest.raises(ValueError, match="rows"):
        chunk_prefill(engine._static.net, 0)
