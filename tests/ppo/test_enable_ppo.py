"""``enable_rapidfire`` on rapidfire_hf's own PPOTrainer, and the value-head model as PPOTrainer's model."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf import AutoModelForCausalLMWithValueHead, enable_rapidfire
from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.integrations.enable import RapidFireIntegrationError
from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.ppo import PPOTrainer
from tests.ppo.helpers import ppo_args, tiny_trainer

SHORT_FORM = {"gradient_pipeline": True, "memory_optimization": "aggressive", "precision": "adaptive"}


def _build(tmp_path, tok, **kw):
    return tiny_trainer(tmp_path, tok, prompts=32, **kw)


def _comparable(log_history):
    """Log rows without wall-clock, throughput and memory entries (they differ between any two runs)."""
    noisy = ("time", "second", "per_s", "tok", "memory", "mem", "_gib", "mfu", "runtime", "flos")
    return [
        {k: v for k, v in row.items() if k != "eps" and not any(n in k for n in noisy)} for row in log_history
    ]


def _policy_state(trainer):
    return {
        k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
    }


def test_enable_equals_rapidfire_config(tmp_path, tokenizer, single_thread):
    torch.manual_seed(0)
    configured = _build(tmp_path / "a", tokenizer, rapidfire_config=SHORT_FORM)
    configured.train()
    torch.manual_seed(0)
    enabled = enable_rapidfire(_build(tmp_path / "b", tokenizer), config=SHORT_FORM)
    assert isinstance(enabled, PPOTrainer)
    assert isinstance(enabled.optimizer.optimizer, RapidFireOptimizer)
    assert enabled.memory_callback.optimization == configured.memory_callback.optimization == "aggressive"
    assert enabled.memory_callback in enabled.callback_handler.callbacks
    assert (enabled.precision_plugin is None) == (configured.precision_plugin is None)
    enabled.train()
    enabled.disable_pipeline()
    assert _comparable(enabled.state.log_history) == _comparable(configured.state.log_history)
    a, b = _policy_state(configured), _policy_state(enabled)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_enable_refuses_after_training_or_twice(tmp_path, tokenizer, single_thread):
    trainer = _build(tmp_path, tokenizer, max_steps=1)
    trainer.train()
    with pytest.raises(RapidFireIntegrationError, match="already trained"):
        enable_rapidfire(trainer, config="balanced")
    fresh = enable_rapidfire(_build(tmp_path / "f", tokenizer), config="balanced")
    with pytest.raises(RapidFireIntegrationError, match="already called"):
        enable_rapidfire(fresh, config="balanced")


def test_enable_keeps_a_user_optimizer(tmp_path, tokenizer):
    user_opt = RapidFireOptimizer(lr=1e-3)
    trainer = PPOTrainer(
        args=ppo_args(tmp_path),
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        value_model=build_tiny_value_model(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
        optimizer=user_opt,
    )
    enable_rapidfire(trainer, config="aggressive")
    assert trainer.optimizer.optimizer is user_opt


def test_value_head_model_trains_as_fused(tmp_path, tokenizer, single_thread):
    """A value-head model passed as ``model`` trains its v_head as the fused value head, and the saved
    output folder loads back into the value-head class and into AutoModelForCausalLM."""
    wrapper = AutoModelForCausalLMWithValueHead(build_tiny_llama(tokenizer))
    head_before = wrapper.v_head.summary.weight.detach().clone()
    trainer = PPOTrainer(
        args=ppo_args(tmp_path),
        processing_class=tokenizer,
        model=wrapper,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
    )
    module = trainer.accelerator.unwrap_model(trainer.model)
    assert module.fused and module.value_head is wrapper.v_head
    trainer.train()
    assert not torch.equal(head_before, wrapper.v_head.summary.weight)
    with pytest.raises(ValueError, match="value head"):
        PPOTrainer(
            args=ppo_args(tmp_path / "x"),
            processing_class=tokenizer,
            model=AutoModelForCausalLMWithValueHead(build_tiny_llama(tokenizer)),
            value_model=build_tiny_value_model(tokenizer),
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(16),
        )
