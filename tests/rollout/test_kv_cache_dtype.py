"""The static engine's 8-bit KV cache (``kv_cache_dtype="fp8"`` / ``"int8"``): bytes, closeness, refusals.

An 8-bit cache changes the arithmetic, so tokens are not compared for equality with a full-precision cache.
What is held instead: each sampled or greedy token's log-prob, computed by the engine over its 8-bit cache,
against a fresh full-precision forward over the same sequence (CPU, fp32). Tolerances, measured on these
models (max over 5 rows x 40 tokens): fp8 4.7e-3, int8 6.7e-4; a scale 1.5x off gives 0.09.
"""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import fresh_logits
from family_cases import CASES, build

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.kernels.kv_quant import SCALE_BYTES
from rapidfire_hf.rollout import RolloutEngine, SamplingParams

# e4m3 keeps 3 mantissa bits (each element within 2^-4 of itself); int8 7 bits of the vector's largest
LOGPROB_ATOL = {"fp8": 2e-2, "int8": 5e-3}
R = 40
# the family cases' larger init (0.1) sharpens the logits: int8 gaps measured up to 0.023 over 16 tokens, and
# up to 0.13 (Mixtral) and 0.30 (FlexOlmo: row 3, step 2, where a router's 2nd and 3rd expert logits are 0.012
# apart) where a router's top-k flips between near-tied experts, the flip then carried by every later token's
# attention (exempting the tied positions alone leaves 0.06); a scale 1.5x off gives 0.27-1.6, which the
# dense families' bound catches
FAMILY_ATOL, FAMILY_ATOL_MOE = 0.05, 0.35


def _engine(model, kv, **kw):
    return RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", kv_cache_dtype=kv, **kw)


def _logprob_gap(model, out, mask) -> float:
    """Max |engine log-prob - fresh forward log-prob| over the response tokens."""
    logits = fresh_logits(model, out.sequences, mask)[:, out.prompt_length - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(-1, out.responses[..., None]).squeeze(-1)
    return float((ref - out.logprobs).abs().max())


def _cache_bytes(engine) -> int:
    buf = engine._static._buf
    tensors = [*buf.k, *buf.v, *(buf.k_scale or []), *(buf.v_scale or [])]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_the_8bit_cache_holds_half_the_bytes_of_bf16(tokenizer, prompts, kv):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2, dtype=torch.bfloat16)  # head_dim 16
    ids, mask = prompts
    held = {}
    for dtype in (None, kv):
        engine = _engine(model, dtype)
        engine.generate(ids, mask, SamplingParams(max_new_tokens=4, do_sample=False))
        held[dtype] = (_cache_bytes(engine), engine.held_bytes())
    d = model.config.hidden_size // model.config.num_attention_heads
    ratio = held[kv][0] / held[None][0]
    # one byte per element plus one fp32 scale per head vector, against two bytes
    assert ratio == pytest.approx((1 + SCALE_BYTES / d) / 2)
    assert ratio < 0.65  # 0.625 at this head width 16; 0.516 at 128
    # held_bytes (what the planner is told) shrinks by the same amount
    assert held[None][1] - held[kv][1] == held[None][0] - held[kv][0]


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_logprobs_over_the_8bit_cache_stay_close_to_a_full_precision_forward(
    tokenizer, prompts, kv, attention
):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    greedy = _engine(model, kv, decode_attention=attention).generate(
        ids, mask, SamplingParams(max_new_tokens=R, do_sample=False)
    )
    assert _logprob_gap(model, greedy, mask) < LOGPROB_ATOL[kv]
    sampled = _engine(model, kv, decode_attention=attention).generate(
        ids, mask, SamplingParams(max_new_tokens=R), generator=torch.Generator().manual_seed(0)
    )
    assert _logprob_gap(model, sampled, mask) < LOGPROB_ATOL[kv]
    # the full-precision cache is exact here: the gap above is the 8-bit cache's
    exact = _engine(model, None, decode_attention=attention).generate(
        ids, mask, SamplingParams(max_new_tokens=R, do_sample=False)
    )
    assert _logprob_gap(model, exact, mask) < 1e-5


def test_triton_attention_dequantizes_inside_the_kernel(tokenizer, prompts):
    from rapidfire_hf.kernels.decode_attention import triton_unavailable_reason

    if why := triton_unavailable_reason(torch.device("cpu")):
        pytest.skip(why)
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    triton = _engine(model, "int8", decode_attention="triton").generate(ids, mask, params)
    matmul = _engine(model, "int8", decode_attention="matmul").generate(ids, mask, params)
    assert _logprob_gap(model, triton, mask) < LOGPROB_ATOL["int8"]
    torch.testing.assert_close(triton.logprobs, matmul.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_every_family_decodes_over_an_8bit_cache(tokenizer, prompts, name):
    """Sliding windows (a ring of ``window`` slots, its scales alongside), soft-capped attention (dequantized
    first), q/k norms, partial rotary, MoE: each family's log-probs over an int8 cache stay close to its own
    forward."""
    c = next(c for c in CASES if c.name == name)
    model = build(c, len(tokenizer))
    ids, mask = prompts
    out = _engine(model, "int8").generate(ids, mask, SamplingParams(max_new_tokens=16, do_sample=False))
    moe = getattr(model.config, "num_experts_per_tok", None) is not None
    assert _logprob_gap(model, out, mask) < (FAMILY_ATOL_MOE if moe else FAMILY_ATOL)


def test_chunked_prefill_fills_the_8bit_cache_as_one_prefill(tokenizer, prompts):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    whole = _engine(model, "fp8").generate(ids, mask, params)
    chunked = _engine(model, "fp8", prefill_chunk_rows=2).generate(ids, mask, params)
    assert torch.equal(whole.responses, chunked.responses)
    torch.testing.assert_close(whole.logprobs, chunked.logprobs, atol=1e-6, rtol=0)


def test_an_8bit_cache_where_it_cannot_act_is_refused_by_name(tokenizer):
    model = build_tiny_llama(tokenizer)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp16'"):
        _engine(model, "fp16")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*True"):
        _engine(model, True)
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' needs the static engine's native .*model\.generate"
    ):
        RolloutEngine(model, pad_token_id=0, backend="hf", kv_cache_dtype="fp8")
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='int8' needs the static engine's native .*'generic'"
    ):
        _engine(model, "int8", decode_path="generic")


def test_the_forward_refuses_a_call_whose_scales_do_not_match_its_cache(tokenizer, prompts):
    from rapidfire_hf.rollout.llama_forward import StaticLlama

    model = build_tiny_llama(tokenizer)
    net = StaticLlama(model, kv_cache_dtype="int8")
    assert net.new_cache(1, 8, "cpu")[0][0].dtype == torch.int8
    ids, mask = prompts
    cos, sin = net.rope_table(torch.arange(ids.shape[1])[None].expand_as(ids))
    k, v = net.new_cache(ids.shape[0], ids.shape[1] + 4, "cpu")
    with pytest.raises(ValueError, match="needs the int8 cache's scales"):
        net.prefill(ids, mask, cos, sin, k, v)
    plain = StaticLlama(model)
    assert plain.new_cache_scales(1, 8, "cpu") is None
    with pytest.raises(ValueError, match="needs no scales"):
        plain.prefill(ids, mask, cos, sin, k, v, scales=net.new_cache_scales(ids.shape[0], 8, "cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["cuda_graph", "compile"])
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_recorded_and_compiled_steps_over_an_8bit_cache_match_the_eager_step(tokenizer, prompts, kv, mode):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2).cuda()
    ids, mask = (t.cuda() for t in prompts)
    params = SamplingParams(max_new_tokens=R, do_sample=False)
    eager = _engine(model, kv, decode_mode="eager", decode_attention="triton").generate(ids, mask, params)
    fast = _engine(model, kv, decode_mode=mode, decode_attention="triton").generate(ids, mask, params)
    assert _logprob_gap(model, fast, mask) < LOGPROB_ATOL[kv]
    torch.testing.assert_close(fast.logprobs, eager.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_a_decode_write_into_an_int8_cache_uses_no_dtype_view(kv):
    """An int8 cache is written by ``index_copy_`` on its own dtype: on one H100 the compiled decode step that
    wrote it through a ``uint8`` view ran 35.95 ms against 13.44 ms for bf16 at 7B batch 128
    (benchmarks/rollout/results/h100/kv_cache_2026-12-07). float8 has no ``index_copy_`` kernel and keeps
    the byte view; both store the quantized bytes at the entry asked and nowhere else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rapidfire_hf.kernels.kv_quant import kv_format, quantize
    from rapidfire_hf.rollout.kv_layout import KVLayout

    fmt = kv_format(kv)
    layout = KVLayout(windows=(None,), sliding_cache="ring", kv_format=fmt, n_kv=2, head_dim=8)
    (cache,), (_,) = layout.new_cache(3, 16, "cpu", torch.float32)
    (scales,), _ = layout.new_cache_scales(3, 16, "cpu")
    torch.manual_seed(0)
    x = torch.randn(3, 2, 1, 8)
    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        layout.write([cache], [scales], 0, x, torch.tensor([5]))
    views = [op for op in ops if op.startswith("aten.view.dtype")]
    assert (views == []) == (kv == "int8"), ops
    q, s = quantize(x, fmt)
    assert torch.equal(cache[:, :, 5:6].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales[:, :, 5], s[:, :, 0])
    others = torch.ones(16, dtype=torch.bool)
    others[5] = False
    assert not cache[:, :, others].float().any() and bool((scales[:, :, others] == 1).all())
