"""Every family case's decode step with each attention implementation the engine can pick on CUDA (the
Triton flash-decoding kernel runs in Triton's interpreter here: tests/conftest.py sets TRITON_INTERPRET=1).
The full greedy runs use the CPU default (SDPA); a per-family switch that one implementation skipped
(soft-capping, a sliding window, the scale from query_pre_attn_scalar or Granite's attention_multiplier)
shows here as a different hidden state after one step past every window."""

from __future__ import annotations

import pytest
import torch
from family_cases import CASES, build, case

from rapidfire_hf.kernels.decode_attention import IMPLS
from rapidfire_hf.rollout.llama_forward import StaticLlama

PROMPT, LENGTH, WARM = 32, 64, 30  # decode slots 32..61 first, then the compared step at slot 62 (> 24 + 31)


def _state(model, prompts):
    """A net on matmul attention, its caches after the prompt and ``WARM`` greedy steps, and the next inputs."""
    ids, mask = prompts
    pad = PROMPT - ids.shape[1]
    ids = torch.cat([ids.new_zeros(ids.shape[0], pad), ids], 1)
    mask = torch.cat([mask.new_zeros(mask.shape[0], pad), mask], 1)
    b = ids.shape[0]
    net = StaticLlama(model, attention="matmul")
    k, v = net.new_cache(b, LENGTH, "cpu")
    full = torch.cat([mask, mask.new_ones(b, LENGTH - PROMPT)], 1)
    cos, sin = net.rope_table((full.cumsum(-1) - 1).clamp_min(0))
    valid = torch.zeros(b, LENGTH, dtype=torch.bool)
    valid[:, :PROMPT] = mask.bool()
    with torch.no_grad():
        tok = net.logits(net.prefill(ids, mask, cos[:, :, :PROMPT], sin[:, :, :PROMPT], k, v)).argmax(-1)
        for slot in range(PROMPT, PROMPT + WARM):
            valid[:, slot] = True
            s = torch.tensor([slot])
            tok = net.logits(net.decode(tok, s, cos[:, :, slot], sin[:, :, slot], valid, k, v)).argmax(-1)
    return net, tok, (k, v), (cos, sin), valid


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "matmul"])
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_decode_step_is_the_same_with_every_attention(tokenizer, prompts, name, impl):
    model = build(case(name), len(tokenizer))
    net, tok, (k, v), (cos, sin), valid = _state(model, prompts)
    slot = PROMPT + WARM
    valid[:, slot] = True
    s = torch.tensor([slot])
    outs = {}
    with torch.no_grad():
        for attention in ("matmul", impl):
            net.attention = attention
            kc, vc = [c.clone() for c in k], [c.clone() for c in v]
            for kv_len in (None, slot + 1):  # the whole cache (compiled) and up to this step (recorded)
                outs[attention, kv_len] = net.decode(
                    tok, s, cos[:, :, slot], sin[:, :, slot], valid, kc, vc, kv_len
                )
    ref = outs["matmul", None]
    for key, out in outs.items():
        assert (out - ref).abs().max() <= 1e-5, key
