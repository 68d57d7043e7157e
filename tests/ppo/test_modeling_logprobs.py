"""PPO log-probs and entropy from hidden states in chunks: equal to the full-logits math, and the training
forward holds no ``[micro-batch, R, V]`` logits tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama, build_tiny_value_model
from rapidfire_hf.memory import activation_bytes
from rapidfire_hf.models.value_head import ValueHead
from rapidfire_hf.ppo import modeling
from rapidfire_hf.ppo.modeling import PolicyAndValue, response_logprobs
from rapidfire_hf.precision.schedule import Precision, set_layer_precision

# fp32 on CPU: the kernel's per-chunk log-sum-exp and recomputed backward differ from one full
# log_softmax only by rounding (measured <= 3e-6 on these shapes)
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def full_logits_reference(hidden, lm_head, responses, temperature):
    logits = lm_head(hidden).float() / (temperature + 1e-7)
    logp = logits.log_softmax(-1)
    return logp.gather(-1, responses[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(b=3, r=7, h=16, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, r, h, generator=g)
    responses = torch.randint(0, v, (b, r), generator=g)
    return hidden, responses


@pytest.mark.parametrize("bias", [False, True])  # a bias: the module path
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equal_to_full_logits_forward_and_grad(bias, temperature):
    hidden, responses = _inputs()
    head = nn.Linear(16, 301, bias=bias)
    grads = []
    for fn in (response_logprobs, full_logits_reference):
        h = hidden.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        lp, ent = fn(h, head, responses, temperature, *(() if fn is full_logits_reference else (True,)))
        up = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
        (lp * up).sum().backward()
        grads.append((lp.detach(), ent.detach(), h.grad, head.weight.grad))
    for name, ours, ref in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), *grads):
        torch.testing.assert_close(ours, ref, **TOL, msg=name)


def test_precision_wrapped_head_computes_in_its_precision():
    hidden, responses = _inputs()
    head = nn.Linear(16, 301, bias=False)
    set_layer_precision(head, Precision.FP32, cast_back=False)  # what the plugin does to the LM head
    assert modeling._kernel_head(head) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = response_logprobs(hidden.bfloat16(), head, responses, 1.0)
        ref, _ = full_logits_reference(hidden.bfloat16(), head, responses, 1.0)
    torch.testing.assert_close(lp, ref, **TOL)  # both fp32: the head's precision, not autocast's bf16


def test_heads_the_kernel_cannot_read_use_the_module():
    hooked = nn.Linear(4, 9, bias=False)
    hooked.register_forward_hook(lambda *a: None)
    for head in (nn.Linear(4, 9), hooked, nn.Sequential(nn.Linear(4, 9))):
        assert modeling._kernel_head(head) is None
    assert modeling._kernel_head(nn.Linear(4, 9, bias=False)) is not None


def _module(fused: bool, vocab: int):
    tok = build_char_tokenizer(vocab_size=vocab)
    policy = build_tiny_llama(tok)
    if fused:
        return PolicyAndValue(policy, value_head=ValueHead(64))
    return PolicyAndValue(policy, value_model=build_tiny_value_model(tok))


@pytest.mark.parametrize("fused", [False, True])
def test_training_forward_holds_no_full_logits(fused):
    vocab, b, ctx, r = 4096, 4, 5, 12
    module = _module(fused, vocab).train()
    qr = torch.randint(3, 40, (b, ctx + r), generator=torch.Generator().manual_seed(0))

    def forward():
        return module(qr, 0, ctx, 0.7, with_entropy=True)

    full_logits = b * r * vocab * 4  # one fp32 [micro-batch, R, V] tensor
    held = activation_bytes(forward)
    # the same forward through full logits (the module path) holds those logits more
    original = modeling._kernel_head
    try:
        modeling._kernel_head = lambda head: None
        assert activation_bytes(forward) - held >= 0.95 * full_logits  # less the kernel's per-token lse
    finally:
        modeling._kernel_head = original
    lp, values, ent = forward()
    assert lp.shape == values.shape == ent.shape == (b, r) and not ent.requires_grad


@pytest.mark.parametrize("fused", [True, False])
def test_values_alone_equal_the_training_forwards(fused):
    """PolicyAndValue.values (scoring) and forward (training) compute values in one place: bit-equal."""
    tok = build_char_tokenizer()
    policy = build_tiny_llama(tok)
    if fused:
        torch.manual_seed(1)
        module = PolicyAndValue(policy, value_head=ValueHead(policy.config.hidden_size))
    else:
        module = PolicyAndValue(policy, value_model=build_tiny_value_model(tok))
    qr = torch.randint(3, len(tok), (3, 12))
    qr[0, :2] = tok.pad_token_id  # a left-padded prompt
    qr[1, -2:] = tok.pad_token_id  # a response ended early
    with torch.no_grad():
        _, values, _ = module(qr, tok.pad_token_id, 5, 1.0)
        alone = module.values(qr, tok.pad_token_id, 5)
    assert values.shape == alone.shape == (3, 7)
    assert torch.equal(values, alone.float())


@pytest.mark.parametrize("fused", [True, False])
def test_the_models_parts_are_looked_up_once_and_not_registered(fused, monkeypatch):
    """The decoder, LM head and value model's backbone/score are found at the first forward, not at each one
    (issue 44: a steady update no longer calls into models/plumbing.py per forward), and the kept parts are
    no submodules of their own (the state dict and the module tree are the models')."""
    module = _module(fused, 64)
    keys = list(module.state_dict())
    calls = []
    for name in ("causal_lm_parts", "classifier_parts"):
        real = getattr(modeling, name)
        monkeypatch.setattr(modeling, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    qr = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = module(qr, 0, 5, 1.0)
        for _ in range(3):
            again = module(qr, 0, 5, 1.0)
            module.values(qr, 0, 5)
    assert sorted(calls) == (["causal_lm_parts"] if fused else ["causal_lm_parts", "classifier_parts"])
    assert all(torch.equal(a, b) for a, b in zip(first[:2], again[:2]))
    assert list(module.state_dict()) == keys and not any("_parts" in n for n, _ in module.named_modules())


def test_a_policy_that_is_not_a_causal_lm_is_refused_at_its_forward():
    """The lookup raises where it did (the first forward), naming the requirement."""
    tok = build_char_tokenizer()
    module = PolicyAndValue(build_tiny_value_model(tok), value_head=ValueHead(64))
    with pytest.raises(TypeError, match="not a supported causal LM"):
        module(torch.randint(3, 40, (1, 6)), 0, 3, 1.0)
