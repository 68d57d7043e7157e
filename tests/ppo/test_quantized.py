"""Frozen reference / reward models in 8-bit and 4-bit (bitsandbytes, which runs these on the CPU too)."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import (
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_value_model,
    make_prompt_dataset,
)
from rapidfire_hf.ppo import PPOTrainer, load_quantized
from rapidfire_hf.ppo.modeling import policy_logprobs
from rapidfire_hf.ppo.quantized import is_quantized
from rapidfire_hf.utils.imports import is_available
from tests.ppo.helpers import ppo_args

needs_bnb = pytest.mark.skipif(not is_available("bitsandbytes"), reason="bitsandbytes not installed")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _args(tmp_path, **kw):
    return ppo_args(tmp_path, gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=1, **kw)


def _rule_trainer(tmp_path, tok, peft_config=None, **args_kw):
    """A trainer scored by a rule (no reward model), to check construction-time errors."""
    return PPOTrainer(
        args=_args(tmp_path, **args_kw),
        processing_class=tok,
        model=build_tiny_llama(tok),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        value_model=build_tiny_value_model(tok),
        train_dataset=make_prompt_dataset(8),
        peft_config=peft_config,
    )


def _linear_kinds(model) -> set[str]:
    return {type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj")}


@needs_bnb
@pytest.mark.parametrize("bits, layer", [("8bit", "Linear8bitLt"), ("4bit", "Linear4bit")])
def test_load_quantized_gives_close_frozen_logprobs(tmp_path, tok, bits, layer):
    model = build_tiny_llama(tok)
    model.save_pretrained(tmp_path)
    q = load_quantized(str(tmp_path), bits, device="cpu", compute_dtype=torch.float32)
    assert is_quantized(q) and _linear_kinds(q) == {layer}
    assert not any(p.requires_grad for p in q.parameters()) and not q.training
    ids = torch.randint(3, tok.vocab_size if hasattr(tok, "vocab_size") else 40, (3, 12))
    with torch.no_grad():
        full = policy_logprobs(model, ids, tok.pad_token_id, 6, 1.0)
        low = policy_logprobs(q, ids, tok.pad_token_id, 6, 1.0)
    # quantization error on a random tiny model: close, not equal
    assert torch.isfinite(low).all() and not torch.equal(full, low)
    assert (full - low).abs().max() < 0.5


@needs_bnb
def test_trainer_quantizes_reference_and_reward_model(tmp_path, tok):
    policy = build_tiny_llama(tok)
    reward = build_tiny_value_model(tok, seed=5)
    args = _args(tmp_path, ref_model_quantization="4bit", reward_model_quantization="8bit")
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=None,
        reward_model=reward,
        value_model=build_tiny_value_model(tok),
        train_dataset=make_prompt_dataset(16),
    )
    assert _linear_kinds(trainer.ref_model) == {"Linear4bit"}
    assert _linear_kinds(trainer.reward_model) == {"Linear8bitLt"}
    with torch.no_grad():  # bitsandbytes' CPU 4-bit kernel repacks the weights at their first use
        trainer.ref_model(torch.randint(3, 30, (1, 8)))
    frozen = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/kl" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["objective/kl"])) for h in logs)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.ref_model.named_parameters())


def test_quantization_option_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="ref_model_quantization='int4'"):
        _args(tmp_path, ref_model_quantization="int4")
    with pytest.raises(ValueError, match="reward_model_quantization='8bit' but there is no such model"):
        _rule_trainer(tmp_path, tok, reward_model_quantization="8bit")
    from peft import LoraConfig

    with pytest.raises(ValueError, match="with LoRA: the reference is the adapter-disabled policy"):
        _rule_trainer(
            tmp_path, tok, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), ref_model_quantization="8bit"
        )


def test_missing_bitsandbytes_names_the_extra(tmp_path, tok, monkeypatch):
    from rapidfire_hf.utils import imports

    original = imports.is_available
    monkeypatch.setattr(imports, "is_available", lambda name: name != "bitsandbytes" and original(name))
    with pytest.raises(ImportError, match=r"frozen model in 8bit.*rapidfire_hf\[bnb\]"):
        _rule_trainer(tmp_path, tok, ref_model_quantization="8bit")
