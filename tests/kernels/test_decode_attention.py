"""gqa_decode_attention against HF-style attention with K/V expanded to every query head."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.kernels import gqa_decode_attention


@pytest.mark.parametrize("impl", ["sdpa", "matmul"])
@pytest.mark.parametrize("b,kv,group,length,d", [(3, 2, 4, 37, 16), (1, 1, 8, 5, 8), (4, 4, 1, 19, 32)])
def test_matches_expanded_reference(b, kv, group, length, d, impl):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, kv, group, d, generator=g)
    k = torch.randn(b, kv, length, d, generator=g)
    v = torch.randn(b, kv, length, d, generator=g)
    valid = torch.rand(b, length, generator=g) < 0.7
    valid[:, -1] = True
    out = gqa_decode_attention(q, k, v, valid, d**-0.5, impl)
    # reference: query head h uses K/V head h // group (HF's repeat_kv order), masked softmax
    qh = q.reshape(b, kv * group, 1, d)
    kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=valid[:, None, None, :])
    torch.testing.assert_close(out.reshape(b, kv * group, 1, d), ref, atol=1e-5, rtol=1e-5)


def test_unknown_impl_is_refused():
    x = torch.zeros(1, 1, 1, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        gqa_decode_attention(x, x, x, torch.ones(1, 1, dtype=torch.bool), 0.5, impl="flash9")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["sdpa", "matmul"])
def test_bf16_on_cuda_matches_fp32(impl):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8, 4, 8, 64, device="cuda", generator=g)
    k = torch.randn(8, 4, 300, 64, device="cuda", generator=g)
    v = torch.randn(8, 4, 300, 64, device="cuda", generator=g)
    valid = torch.ones(8, 300, dtype=torch.bool, device="cuda")
    valid[:3, 200:] = False
    ref = gqa_decode_attention(q, k, v, valid, 0.125, "matmul")
    out = gqa_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), valid, 0.125, impl)
    # bf16 inputs: ~3 significant digits
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_auto_resolves_to_the_triton_kernel_only_where_it_runs_recorded(monkeypatch):
    import rapidfire_hf.kernels.decode_attention as da

    assert da.resolve_impl("auto", torch.device("cpu")) == "sdpa"  # no CUDA
    for name in da.IMPLS:
        assert da.resolve_impl(name, torch.device("cpu")) == name  # a named one is kept
    with pytest.raises(ValueError, match="decode attention must be one of"):
        da.resolve_impl("flash9", torch.device("cpu"))
    # a CUDA device as the resolver sees it: Triton available, a given compute capability
    monkeypatch.setattr(da, "triton_unavailable_reason", lambda device: None)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    cuda = torch.device("cuda", 0)
    assert da.resolve_impl("auto", cuda) == "triton"
    assert da.resolve_impl("auto", cuda, recorded=False) == "sdpa"  # eager steps: host launch cost
    capability["value"] = (7, 5)  # no bf16 dot products
    assert da.resolve_impl("auto", cuda) == "sdpa"
    capability["value"] = (8, 0)
    monkeypatch.setattr(da, "triton_unavailable_reason", lambda device: "Triton is not installed")
    assert da.resolve_impl("auto", cuda) == "sdpa"


def test_the_engine_and_ppo_config_default_to_auto(tokenizer):
    from rapidfire_hf.demo import build_tiny_llama
    from rapidfire_hf.ppo.config import PPOConfig
    from rapidfire_hf.rollout import RolloutEngine

    assert PPOConfig(output_dir="unused").rollout_decode_attention == "auto"
    engine = RolloutEngine(build_tiny_llama(tokenizer), 0, [], backend="static", decode_mode="eager")
    assert engine._static.attention == "sdpa"  # what auto became on the CPU
