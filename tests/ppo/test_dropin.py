"""Drop-in details for TRL users: an optimizer without hyper-parameters takes PPOConfig's, and the old
TRL keywords ``config=`` / ``tokenizer=`` still work, with a warning naming the new ones."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.ppo import PPOTrainer
from tests.ppo.helpers import ppo_args, tiny_trainer


def _trainer(tmp_path, tok, optimizer=None, **kw):
    return tiny_trainer(tmp_path, tok, trainer_kwargs={"optimizer": optimizer}, **kw)


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


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_optimizer_precision_sets_the_trainer_precision(tmp_path, tokenizer, precision, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="rapidfire_hf.ppo"):
        trainer = _trainer(
            tmp_path,
            tokenizer,
            RapidFireOptimizer(precision=precision, enable_fused_kernels=True),
            max_steps=1,
        )
    assert trainer.accelerator.mixed_precision == precision
    trainer.train()  # the snippet users copy trains
    assert trainer.state.global_step == 1
    assert any("enable_fused_kernels" in r.getMessage() for r in caplog.records)
    assert not any("gradient pipeline" in r.getMessage() for r in caplog.records)  # the pipeline is off here
    other = "fp16" if precision == "bf16" else "bf16"
    from rapidfire_hf.config.errors import ConfigError

    with pytest.raises(ConfigError, match="set one of them"):
        _trainer(tmp_path / "x", tokenizer, RapidFireOptimizer(precision=precision), **{other: True})


def test_optimizer_precision_and_non_settings_are_checked():
    with pytest.raises(ValueError, match="choose 'bf16', 'fp16'"):
        RapidFireOptimizer(precision="fp8")
    with pytest.raises(ValueError, match="gradient_pipeline=False"):
        RapidFireOptimizer(precision="fp16", gradient_pipeline=True)
    with pytest.raises(TypeError, match="acceleration_factor=...\\) is not a setting"):
        RapidFireOptimizer(acceleration_factor=2.0)


def test_plain_loop_fp16_loss_scaling_through_grad_scaler():
    """GradScaler drives RapidFireOptimizer as it drives the inner AdamW: same weights, and an overflowing
    step is skipped by both (the optimizer exposes the inner optimizer's param groups)."""

    def run(make_opt):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = make_opt(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for step in range(4):
            x = torch.randn(16, 8)
            loss = model(x).square().mean() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model.state_dict(), scaler.get_scale()

    ours, scale_ours = run(lambda p: RapidFireOptimizer(p, lr=1e-2, precision="fp16", rollback="off"))
    ref, scale_ref = run(lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True))
    assert scale_ours == scale_ref == 2.0**10 * 0.5  # the overflow halved the scale once
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=0, atol=0, msg=key)
