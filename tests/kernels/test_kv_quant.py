"""8-bit KV cache elements (``kernels/kv_quant.py``) and the attention that reads them, against fp32 references."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.kernels import gqa_decode_attention
from rapidfire_hf.kernels.kv_quant import KV_FORMATS, dequantize, element_bytes, kv_format, quantize


def _vectors(seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes from 1e-4 to 1e2 across vectors (a per-vector scale must follow each), some exact zeros
    x = torch.randn(3, 2, 50, 16, generator=g) * torch.logspace(-4, 2, 50)[None, None, :, None]
    x[0, 0, 7] = 0.0
    return x


def test_int8_error_is_half_a_step_of_the_vectors_own_scale():
    x = _vectors()
    q, s = quantize(x, KV_FORMATS["int8"])
    assert q.dtype == torch.int8 and s.shape == x.shape[:-1] and s.dtype == torch.float32
    amax = x.abs().amax(-1)
    err = (dequantize(q, s, torch.float32) - x).abs().amax(-1)
    assert (err <= amax / 127 / 2 * (1 + 1e-5)).all()
    assert (q.abs().amax(-1)[amax > 0] == 127).all()  # the largest element maps to the format's largest
    assert (dequantize(q, s, torch.float32)[0, 0, 7] == 0).all() and s[0, 0, 7] == 1  # zeros stay, no 0/0


def test_fp8_error_is_relative_to_each_element():
    x = _vectors()
    q, s = quantize(x, KV_FORMATS["fp8"])
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize(q, s, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # 3 mantissa bits: within 2^-4 of the element, or of e4m3's smallest subnormal step (2^-9 of qmax=448)
    # below its normal range
    bound = torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-9) * (1 + 1e-5)
    assert ((back - x).abs() <= bound).all()
    assert torch.isfinite(back).all()


def test_unknown_formats_are_refused_by_name():
    assert kv_format(None) is None and kv_format("int8").qmax == 127
    for bad in ("fp16", "FP8", 8, True):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            kv_format(bad)
    assert element_bytes(None, 2, 128) == 2 and element_bytes("fp8", 2, 128) == 1 + 4 / 128


def _attention_inputs(seed=0, b=2, kv=2, group=4, length=100, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kv, group, d, generator=g)
    k = torch.randn(b, kv, length, d, generator=g)
    v = torch.randn(b, kv, length, d, generator=g)
    valid = torch.rand(b, length, generator=g) < 0.7
    return q, k, v, valid


def _impls():
    from rapidfire_hf.kernels.decode_attention import triton_unavailable_reason

    triton_ok = triton_unavailable_reason(torch.device("cpu")) is None
    return [
        "sdpa",
        "matmul",
        pytest.param("triton", marks=pytest.mark.skipif(not triton_ok, reason="no Triton")),
    ]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("fmt", list(KV_FORMATS))
def test_attention_over_an_8bit_cache_equals_attention_over_its_dequantized_values(impl, fmt):
    q, k, v, valid = _attention_inputs()
    k8, ks = quantize(k, KV_FORMATS[fmt])
    v8, vs = quantize(v, KV_FORMATS[fmt])
    ref = gqa_decode_attention(
        q, dequantize(k8, ks, q.dtype), dequantize(v8, vs, q.dtype), valid, 0.25, "matmul"
    )
    n = 70  # a length slice of the cache, as a bucketed decode step reads it
    out = gqa_decode_attention(q, k8, v8, valid, 0.25, impl, k_scale=ks, v_scale=vs)
    sliced = gqa_decode_attention(
        q, k8[:, :, :n], v8[:, :, :n], valid[:, :n], 0.25, impl, k_scale=ks[:, :, :n], v_scale=vs[:, :, :n]
    )
    ref_sliced = gqa_decode_attention(
        q,
        dequantize(k8, ks, q.dtype)[:, :, :n],
        dequantize(v8, vs, q.dtype)[:, :, :n],
        valid[:, :n],
        0.25,
        "matmul",
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sliced, ref_sliced, atol=1e-5, rtol=1e-5)
    # and the 8-bit cache is a close stand-in for the full-precision one
    full = gqa_decode_attention(q, k, v, valid, 0.25, "matmul")
    assert (out - full).abs().max() < (0.05 if fmt == "fp8" else 0.01)


def test_triton_kernel_with_scales_splits_and_bounds_like_without():
    from rapidfire_hf.kernels.decode_attention import triton_unavailable_reason

    if why := triton_unavailable_reason(torch.device("cpu")):
        pytest.skip(why)
    from rapidfire_hf.kernels.triton_flash_decode import flash_decode

    q, k, v, valid = _attention_inputs(seed=1)
    k8, ks = quantize(k, KV_FORMATS["int8"])
    v8, vs = quantize(v, KV_FORMATS["int8"])
    valid[:, 80:] = False
    one = flash_decode(q, k8, v8, valid, 0.25, splits=1, k_scale=ks, v_scale=vs)
    three = flash_decode(q, k8, v8, valid, 0.25, splits=3, k_scale=ks, v_scale=vs)
    bounded = flash_decode(
        q, k8, v8, valid, 0.25, splits=3, kv_end=torch.tensor([80]), k_scale=ks, v_scale=vs
    )
    torch.testing.assert_close(three, one, atol=1e-6, rtol=1e-6)
    assert torch.equal(bounded, three)


def test_scales_that_do_not_fit_the_cache_are_refused():
    q, k, v, valid = _attention_inputs()
    k8, ks = quantize(k, KV_FORMATS["int8"])
    v8, vs = quantize(v, KV_FORMATS["int8"])
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        gqa_decode_attention(q, k8, v8, valid, 0.25, "sdpa", k_scale=ks)
    from rapidfire_hf.kernels.decode_attention import triton_unavailable_reason

    if triton_unavailable_reason(torch.device("cpu")) is None:
        from rapidfire_hf.kernels.triton_flash_decode import flash_decode

        with pytest.raises(ValueError, match=r"fp32 \[B, KV, L\]"):
            flash_decode(q, k8, v8, valid, 0.25, k_scale=ks[:, :, :10], v_scale=vs[:, :, :10])
        with pytest.raises(ValueError, match="needs k_scale / v_scale"):
            flash_decode(q, k8, v8, valid, 0.25)
