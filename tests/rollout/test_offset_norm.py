"""Gemma's (1 + w) RMSNorms in the static forward (families.py ``offset_norm``): computed from their weights
with ``1 + w`` precomputed once per generation, q and k normed in one pass; the same bits as the modules,
fewer ops per decode step, and the precomputed scales follow the weights between generations."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy
from family_cases import build, case
from torch.utils._python_dispatch import TorchDispatchMode

from rapidfire_hf.rollout import RolloutEngine, SamplingParams
from rapidfire_hf.rollout.llama_forward import StaticLlama, is_offset_norm, offset_rms_norm

GEMMAS = ["gemma", "gemma2", "gemma3_text"]


def _engine(model, **kw):
    return RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native", **kw
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_is_the_modules_arithmetic_bit_for_bit(tokenizer, dtype):
    model = build(case("gemma3_text"), len(tokenizer)).to(dtype)
    attn = model.model.layers[0].self_attn
    norm = model.model.layers[0].post_feedforward_layernorm
    with torch.no_grad():
        norm.weight.normal_()
        attn.q_norm.weight.normal_()
        attn.k_norm.weight.normal_()
        x = torch.randn(3, 5, norm.weight.shape[0], dtype=dtype) * 4
        assert torch.equal(offset_rms_norm(x, 1.0 + norm.weight.float(), norm.eps), norm(x))
        # q and k in one pass, their scales stacked per head: each row as its own module computes it
        q, k = torch.randn(3, 4, 16, dtype=dtype), torch.randn(3, 2, 16, dtype=dtype)
        net = StaticLlama(model)
        qk = offset_rms_norm(torch.cat([q, k], dim=-2), net._qk_scale[0], attn.q_norm.eps)
        assert torch.equal(qk[:, :4], attn.q_norm(q)) and torch.equal(qk[:, 4:], attn.k_norm(k))


@pytest.mark.parametrize("name", GEMMAS)
def test_every_gemma_norm_runs_the_offset_form(tokenizer, name):
    net = StaticLlama(build(case(name), len(tokenizer)))
    assert all(all(n is None or s is not None for n, s in zip(norms, scales))
               for norms, scales in zip(net.norms, net._norm_scale))  # fmt: skip
    assert net._final_scale is not None
    assert all(s is not None for s in net._qk_scale) == (name == "gemma3_text")
    # other families keep their module calls
    llama = StaticLlama(build(case("qwen3"), len(tokenizer)))
    assert llama.norm_scales() == () and not any(map(any, llama._offset))


def test_a_patched_norm_keeps_its_module_call(tokenizer):
    model = build(case("gemma3_text"), len(tokenizer))
    norm = model.model.layers[1].input_layernorm
    assert is_offset_norm(norm)
    norm.forward = lambda x: x  # e.g. a kernel library's forward put on the instance
    assert not is_offset_norm(norm)
    assert not is_offset_norm(torch.nn.LayerNorm(8)) and not is_offset_norm(torch.nn.RMSNorm(8))
    net = StaticLlama(model)
    assert net._norm_scale[1][0] is None and net._norm_scale[0][0] is not None


def test_the_scales_follow_the_weights_between_generations(tokenizer, prompts):
    """A training update changes the norms' weights in place: the next generation must decode with them."""
    model = build(case("gemma3_text"), len(tokenizer))
    ids, mask = prompts
    engine = _engine(model)
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    engine.generate(ids, mask, params)
    with torch.no_grad():
        for p_ in model.parameters():
            if p_.dim() == 1:  # every norm weight, as an optimizer step would move them
                p_.add_(torch.randn_like(p_))
    out = engine.generate(ids, mask, params)
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 12, stop=None))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _decode_ops(net, b: int = 2, length: int = 8) -> int:
    k, v = net.new_cache(b, length, "cpu")
    cos, sin = net.rope_table(torch.arange(length).expand(b, length))
    valid = torch.ones(b, length, dtype=torch.bool)
    with torch.no_grad(), _CountOps() as ops:
        net.decode(
            torch.ones(b, dtype=torch.long), torch.tensor([3]), cos[:, :, 3], sin[:, :, 3], valid, k, v
        )
    return ops.n


def test_the_offset_form_issues_fewer_ops_per_decode_step(tokenizer):
    """What the switch is for (issue 45: Gemma-3-1B's recorded step was 1.63x Llama's per weight byte, six
    unfused norms a layer): per bf16 layer, 2 ops fewer per norm, one q/k norm pass instead of two and one
    rotary pass over q and k together."""
    model = build(case("gemma3_text"), len(tokenizer)).to(torch.bfloat16)
    net = StaticLlama(model)
    fast = _decode_ops(net)
    net._norm_scale = [[None] * 4 for _ in net.layers]
    net._final_scale, net._qk_scale = None, [None] * len(net.layers)
    modules = _decode_ops(net)
    # per layer: 4 sandwich norms x 2; q/k norms 2 x 2 and one pass's 7 less the cat; a rotary pass (5);
    # the final norm 2 (493 -> 367 aten ops on the CPU, torch 2.13, views included)
    assert modules - fast >= len(net.layers) * (4 * 2 + 2 * 2 + 7 - 1 + 5) + 2, (modules, fast)
