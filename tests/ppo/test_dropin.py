"""Drop-in details for TRL users: an optimizer without hyper-parameters takes PPOConfig's, and the old
TRL keywords ``config=`` / ``tokenizer=`` still work, with a warning naming the new ones."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.ppo import PPOTrainer
from tests.ppo.helpers import ppo_args


def _trainer(tmp_path, tok, optimizer=None, **kw):
    return PPOTrainer(
        args=ppo_args(tmp_path, **kw),
        processing_class=tok,
        model=build_tiny_llama(tok),
        value_model=build_tiny_value_model(tok),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
        optimizer=optimizer,
    )


def test_optimizer_without_lr_takes_the_config_hyper_parameters(tmp_path, tokenizer, single_thread):
    hyper = dict(learning_rate=3e-4, weight_decay=0.0, adam_beta1=0.8, adam_epsilon=1e-6)
    torch.manual_seed(0)
    wrapped = _trainer(tmp_path / "rf", tokenizer, RapidFireOptimizer(), **hyper)
    inner = wrapped.optimizer.optimizer.inner
    assert inner.defaults["weight_decay"] == 0.0 and inner.defaults["betas"][0] == 0.8
    assert inner.defaults["eps"] == 1e-6
    wrapped.train()
    torch.manual_seed(0)
    plain = _trainer(tmp_path / "plain", tokenizer, **hyper)
    assert isinstance(plain.optimizer.optimizer, torch.optim.AdamW)
    plain.train()
    a = wrapped.accelerator.unwrap_model(wrapped.model).state_dict()
    b = plain.accelerator.unwrap_model(plain.model).state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_optimizer_settings_given_by_the_user_are_kept(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, RapidFireOptimizer(lr=1e-4, weight_decay=0.2), learning_rate=3e-6)
    inner = trainer.optimizer.optimizer.inner
    assert inner.defaults["lr"] == 1e-4 and inner.defaults["weight_decay"] == 0.2


def test_old_trl_keywords(tmp_path, tokenizer):
    with pytest.warns(FutureWarning, match="use args=") as record:
        trainer = PPOTrainer(
            config=ppo_args(tmp_path),
            tokenizer=tokenizer,
            model=build_tiny_llama(tokenizer),
            value_model=build_tiny_value_model(tokenizer),
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(16),
        )
    assert any("use processing_class=" in str(w.message) for w in record)
    assert trainer.processing_class is tokenizer
    with pytest.raises(TypeError, match="both config= and args="):
        PPOTrainer(args=ppo_args(tmp_path), config=ppo_args(tmp_path), model=build_tiny_llama(tokenizer))
    with pytest.raises(TypeError, match="unexpected keyword"):
        PPOTrainer(
            args=ppo_args(tmp_path),
            processing_class=tokenizer,
            model=build_tiny_llama(tokenizer),
            acceleration_factor=2,
        )
