"""The per-row-adapter LoRA linear: a batch of mixed adapters equals each adapter's rows run alone
(logits and gradients, bit-exact on CPU fp32), and one adapter equals peft's LoRA layer bit for bit."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.sweep import AdapterBank

from .helpers import lora_config


def _bank_with_adapters(tokenizer, n: int):
    model = build_tiny_llama(tokenizer)
    bank = AdapterBank(model, lora_config())
    for i in range(n):
        bank.add(f"t{i}", seed=i)
        with torch.no_grad():  # B is zero at init; give every adapter a visible effect
            gen = torch.Generator().manual_seed(100 + i)
            for p in bank.parameters(f"t{i}")[1::2]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, bank


def _loss(model, ids):
    return model(input_ids=ids).logits.float().pow(2).mean(dim=(1, 2))  # one loss per row


@pytest.mark.usefixtures("single_thread")
def test_mixed_batch_equals_each_adapter_alone(tokenizer):
    model, bank = _bank_with_adapters(tokenizer, 3)
    rows = [3, 2, 4]
    ids = torch.randint(4, len(tokenizer), (sum(rows), 11), generator=torch.Generator().manual_seed(0))
    with bank.route([(f"t{i}", n) for i, n in enumerate(rows)]):
        losses = _loss(model, ids)
    losses.sum().backward()
    joint_grads = {s: [p.grad.clone() for p in bank.parameters(s)] for s in bank.slots}
    model.zero_grad(set_to_none=True)
    start = 0
    for i, n in enumerate(rows):
        with bank.route([(f"t{i}", n)]):
            alone = _loss(model, ids[start : start + n])
        alone.sum().backward()
        assert torch.equal(alone, losses[start : start + n].detach()), f"adapter t{i}: forward differs"
        for g_joint, p in zip(joint_grads[f"t{i}"], bank.parameters(f"t{i}")):
            assert torch.equal(g_joint, p.grad), f"adapter t{i}: gradient differs"
        model.zero_grad(set_to_none=True)
        start += n


@pytest.mark.usefixtures("single_thread")
def test_none_rows_are_the_base_model(tokenizer):
    model, bank = _bank_with_adapters(tokenizer, 1)
    reference = build_tiny_llama(tokenizer)
    ids = torch.randint(4, len(tokenizer), (4, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), bank.route([(None, 2), ("t0", 2)]):
        mixed = model(input_ids=ids).logits
    with torch.no_grad():
        base = reference(input_ids=ids).logits
        with bank.route([("t0", 4)]):
            adapted = model(input_ids=ids).logits
    assert torch.equal(mixed[:2], base[:2])
    assert torch.equal(mixed[2:], adapted[2:])
    assert not torch.equal(adapted[:2], base[:2])  # the adapter does something


@pytest.mark.usefixtures("single_thread")
def test_one_adapter_equals_peft_lora(tokenizer):
    from peft import get_peft_model, set_peft_model_state_dict

    model, bank = _bank_with_adapters(tokenizer, 1)
    peft_model = get_peft_model(build_tiny_llama(tokenizer), lora_config())
    result = set_peft_model_state_dict(peft_model, bank.state_dict("t0"))
    assert not result.unexpected_keys
    ids = torch.randint(4, len(tokenizer), (3, 10), generator=torch.Generator().manual_seed(2))
    with bank.route([("t0", 3)]):
        ours = _loss(model, ids)
    theirs = _loss(peft_model, ids)
    assert torch.equal(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    peft_grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
    assert all(torch.equal(a.grad, b) for a, b in zip(bank.parameters("t0"), peft_grads))


def test_bank_errors(tokenizer):
    from peft import LoraConfig, get_peft_model

    with pytest.raises(ValueError, match="matches no nn.Linear"):
        AdapterBank(build_tiny_llama(tokenizer), LoraConfig(r=2, target_modules=["nope"]))
    with pytest.raises(ValueError, match="not a PeftModel"):
        AdapterBank(get_peft_model(build_tiny_llama(tokenizer), lora_config()), lora_config())
    with pytest.raises(ValueError, match="use_dora"):
        AdapterBank(build_tiny_llama(tokenizer), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))


@pytest.mark.parametrize("key", ["ref_adapter_name", "model_adapter_name"])
def test_sweep_refuses_the_adapter_keys(tokenizer, tmp_path, key):
    """Each trial trains its own adapter against the shared base: PPOConfig's adapter names do not apply."""
    from rapidfire_hf.config.errors import ConfigError

    from .helpers import make_sweep

    with pytest.raises(ConfigError, match=rf"{key}: PPOSweep does not apply it: each trial trains its own adapter"):
        make_sweep(tokenizer, tmp_path, {"a": {}}, **{key: "ref"})
