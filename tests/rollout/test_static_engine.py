"""The static engine against ``model.generate`` and a fresh forward pass (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import fresh_logits, hf_greedy

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams

R = 24
LONG = 90  # crosses the 64-slot KV buckets twice


# "triton": the flash-decoding kernel (the CUDA default) in Triton's interpreter, ~25 s on a 2-core CPU
@pytest.mark.parametrize("attention", ["sdpa", "matmul", pytest.param("triton", marks=pytest.mark.slow)])
def test_greedy_matches_generate_without_stop(tokenizer, prompts, attention):
    from rapidfire_hf.kernels.decode_attention import triton_unavailable_reason

    if attention == "triton" and (why := triton_unavailable_reason(torch.device("cpu"))):
        pytest.skip(why)
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)  # GQA, group 2
    ids, mask = prompts
    engine = RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_attention=attention
    )
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=LONG, do_sample=False))
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, LONG, stop=None))
    assert out.response_mask.all()
    assert torch.equal(out.sequences[:, : out.prompt_length], ids)


def test_greedy_matches_generate_with_stop(tokenizer, prompts):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=1, seed=3)
    ids, mask = prompts
    free = hf_greedy(model, ids, mask, R, stop=None)
    # a stop token that ends some rows mid-way: the most common token at position 5
    stop = int(free[:, 5].mode().values)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[stop], backend="static")
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=R, do_sample=False))
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, R, stop=stop))
    stopped = (free == stop).any(-1)
    assert stopped.any() and not out.response_mask.all()
    for row in range(ids.shape[0]):
        n = int(out.response_mask[row].sum())
        if stopped[row]:
            assert out.responses[row, n - 1] == stop  # the stop token itself is kept and masked in
        assert (out.responses[row, n:] == 0).all() and (out.logprobs[row, n:] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_fresh_forward(tokenizer, prompts, temperature):
    model = build_tiny_llama(tokenizer)
    ids, mask = prompts
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[2], backend="static")
    params = SamplingParams(max_new_tokens=R, temperature=temperature)
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
    logits = fresh_logits(model, out.sequences, mask)[:, out.prompt_length - 1 : -1]
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, out.responses[..., None]).squeeze(-1)
    ref = ref.masked_fill(~out.response_mask, 0.0)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible(tokenizer, prompts):
    model = build_tiny_llama(tokenizer)
    ids, mask = prompts
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static")
    params = SamplingParams(max_new_tokens=R)
    a = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(7))
    b = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(7))
    c = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.responses, c.responses)


def test_train_mode_and_grad_state_restored(tokenizer, prompts):
    model = build_tiny_llama(tokenizer)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False  # what TRL does with gradient checkpointing
    model.train()
    ids, mask = prompts
    for backend in ("static", "hf"):
        out = RolloutEngine(model, pad_token_id=0, backend=backend).generate(
            ids, mask, SamplingParams(max_new_tokens=8, do_sample=False)
        )
        assert model.training and model.model.gradient_checkpointing
        assert not out.logprobs.requires_grad and out.responses.shape == (ids.shape[0], 8)
    # train mode must not have leaked dropout into generation: same tokens as in eval mode
    model.config.attention_dropout = 0.0
    model.eval()
    ref = hf_greedy(model, ids, mask, 8, stop=2)
    assert torch.equal(out.responses, ref)


def test_buffers_are_reused_across_calls(tokenizer, prompts):
    model = build_tiny_llama(tokenizer)
    ids, mask = prompts
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static")
    params = SamplingParams(max_new_tokens=R, do_sample=False)
    first = engine.generate(ids, mask, params)
    cache = engine._static._buf.k
    # one pad column more still fits the same 32-wide prompt bucket
    ids2 = torch.cat([torch.zeros_like(ids[:, :1]), ids], 1)
    mask2 = torch.cat([torch.zeros_like(mask[:, :1]), mask], 1)
    second = engine.generate(ids2, mask2, params)
    assert engine._static._buf.k is cache
    assert torch.equal(first.responses, second.responses)
    engine.release()
    assert engine._static._buf is None
    assert torch.equal(engine.generate(ids, mask, params).responses, first.responses)


def test_decode_step_is_idempotent(tokenizer, prompts, monkeypatch):
    """CUDA-graph recording runs each new step's body up to 3 times; the result must not change."""
    from rapidfire_hf.rollout.static_engine import StaticEngine

    model = build_tiny_llama(tokenizer, seed=3)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=LONG, temperature=0.9, top_k=12)
    stop = 19  # a stop token some rows produce, so the "done" logic is exercised too

    def run():
        engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[stop], backend="static")
        return engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(4))

    once = run()
    step = StaticEngine._step

    def three_times(self, p, kv_len):
        for _ in range(3):
            step(self, p, kv_len)

    monkeypatch.setattr(StaticEngine, "_step", three_times)
    thrice = run()
    assert torch.equal(once.responses, thrice.responses) and torch.equal(once.logprobs, thrice.logprobs)
    assert not once.response_mask.all()


def test_tied_embeddings_and_llama3_rope_scaling(tokenizer, prompts):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    }
    model = build_tiny_llama(tokenizer, tie_word_embeddings=True, rope_parameters=rope)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, mask = prompts
    out = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static").generate(
        ids, mask, SamplingParams(max_new_tokens=40, do_sample=False)
    )
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 40, stop=None))


def test_auto_decode_mode_compiles_a_bounded_number_of_shapes(tokenizer):
    """On CUDA "auto" compiles the step for the first MAX_COMPILED_SHAPES shapes, then only records graphs;
    on CPU it is eager. (The choice alone is checked here; the compiled step itself runs in the GPU tests.)"""
    from types import SimpleNamespace

    from rapidfire_hf.rollout.static_engine import MAX_COMPILED_SHAPES, StaticEngine

    engine = StaticEngine(build_tiny_llama(tokenizer), pad_token_id=0, stop_token_ids=[])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    modes = []
    for b in range(1, MAX_COMPILED_SHAPES + 3):
        engine._buf = SimpleNamespace(shape=(b, 32, 16))
        modes.append(engine._mode(cuda))
        assert engine._mode(cpu) == "eager"
    assert modes == ["compile"] * MAX_COMPILED_SHAPES + ["cuda_graph"] * 2
    engine._buf = SimpleNamespace(shape=(1, 32, 16))  # a shape compiled before stays compiled
    assert engine._mode(cuda) == "compile"
    fixed = StaticEngine(
        build_tiny_llama(tokenizer), pad_token_id=0, stop_token_ids=[], decode_mode="cuda_graph"
    )
    fixed._buf = SimpleNamespace(shape=(1, 32, 16))
    assert fixed._mode(cuda) == "cuda_graph"
