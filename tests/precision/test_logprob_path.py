"""The log-prob path (final norm + LM head) in fp32: found through wrappers, outputs kept in fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.precision import AdaptivePrecisionPlugin, Precision, logprob_path


class _PolicyAndValue(nn.Module):
    """Like PPO's trainable module: a causal LM and a value head side by side, no head of its own."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.value = nn.Linear(policy.config.hidden_size, 1)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 46, (2, 12), generator=torch.Generator().manual_seed(seed))


def _logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_logprob_path_of_a_causal_lm_and_of_a_wrapper():
    policy = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    path = logprob_path(policy)
    assert list(path) == ["model.norm", "lm_head"]
    assert path["lm_head"] is policy.lm_head and path["model.norm"] is policy.model.norm
    assert list(logprob_path(_PolicyAndValue(policy))) == ["policy.model.norm", "policy.lm_head"]
    assert logprob_path(nn.Sequential(nn.Linear(4, 4))) == {}


def test_set_logprob_path_on_a_wrapped_bf16_policy_gives_fp32_logits():
    torch.manual_seed(0)
    fp32 = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    ids = _ids()
    with torch.no_grad():
        reference = _logprobs(fp32, ids)
    policy = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1, dtype=torch.bfloat16)
    wrapper = _PolicyAndValue(policy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_logits = policy(input_ids=ids).logits
        bf16_error = (_logprobs(policy, ids) - reference).abs().max()
    assert bf16_logits.dtype == torch.bfloat16

    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    plugin = AdaptivePrecisionPlugin(initial="bf16", fallback=[]).attach(model=wrapper, optimizer=opt)
    actions = plugin.set_logprob_path()
    assert [a.target for a in actions] == ["policy.model.norm", "policy.lm_head"]
    assert plugin.precision_of("policy.lm_head") is Precision.FP32
    assert policy.lm_head.weight.dtype == policy.model.norm.weight.dtype == torch.float32
    assert policy.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # the rest stays bf16

    # the wrapper has no get_output_embeddings(): the head must still keep its fp32 output (it was cast
    # back to bf16 before), and so must the final norm that feeds it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = policy.model(input_ids=ids).last_hidden_state
        logits = policy(input_ids=ids).logits
        adaptive_error = (_logprobs(policy, ids) - reference).abs().max()
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32
    assert adaptive_error < bf16_error

    # and without autocast (how the rollout engine calls a bf16 model)
    with torch.no_grad():
        assert policy(input_ids=ids).logits.dtype == torch.float32

    # trains: gradients reach both precisions, the optimizer steps over mixed dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = -_logprobs(policy, ids).mean() + wrapper.value(policy.model(input_ids=ids)[0]).pow(2).mean()
    loss.backward()
    opt.step()
    assert policy.lm_head.weight.grad.dtype == torch.float32
    assert policy.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.bfloat16


def test_logprob_path_schedule_survives_state_dict():
    policy = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    plugin = AdaptivePrecisionPlugin(initial="bf16", fallback=[]).attach(model=policy)
    plugin.set_logprob_path("fp32")
    state = plugin.state_dict()
    assert state["overrides"] == {"model.norm": "fp32", "lm_head": "fp32"}

    policy2 = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    restored = AdaptivePrecisionPlugin(initial="bf16", fallback=[]).attach(model=policy2)
    restored.load_state_dict(state)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy2(input_ids=_ids()).logits.dtype == torch.float32


def test_tied_low_precision_head_is_refused_and_fp32_master_weights_are_fine():
    tied = dict(hidden=32, layers=2, heads=2, kv_heads=1, tie_word_embeddings=True)
    policy = build_tiny_llama(None, dtype=torch.bfloat16, **tied)
    plugin = AdaptivePrecisionPlugin(initial="bf16", fallback=[]).attach(model=policy)
    with pytest.raises(ValueError, match="tied input/output embeddings"):
        plugin.set_logprob_path()
    assert plugin.overrides == {} and policy.lm_head.weight.dtype == torch.bfloat16  # nothing switched

    policy = build_tiny_llama(None, **tied)  # fp32 master weights: nothing to convert, works
    plugin = AdaptivePrecisionPlugin(initial="bf16", fallback=[]).attach(model=policy)
    plugin.set_logprob_path()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy(input_ids=_ids()).logits.dtype == torch.float32
