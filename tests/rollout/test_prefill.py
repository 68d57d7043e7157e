"""``RolloutEngine(prefill_chunk_rows=...)`` against the engine without it and against ``model.generate``
(CPU, fp32; the chunk-level checks of the cache rows are in tests/integrations/test_grpo_lowmem.py)."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams

R = 12


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
