"""SFTTrainer, DPOTrainer and RewardTrainer with enable_rapidfire against the stock trainers: same seed, same curves.

Both runs are fp32 on CPU in one process. The rapidfire run has the gradient pipeline on and
``rollback="auto"``: each parameter is stepped by the same torch AdamW, one tensor at a time inside
backward, where the stock trainer steps all of them with foreach kernels after backward. The arithmetic
per element is the same, so losses and parameters agree to fp32 round-off; the tolerances below
(rtol 1e-5 on losses, atol 1e-6 on parameters after 4 AdamW steps at lr 1e-3) leave room for the
different kernel order only.
"""

from __future__ import annotations

import pytest
import torch
from rf_trainers import PARITY_CONFIG, STEPS, train_log

from rapidfire_hf.integrations import enable_rapidfire

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-6


def _max_param_diff(a, b) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    "kind, max_grad_norm",
    [("sft", 0.0), ("sft", 1.0), ("dpo", 0.0), ("dpo", 1.0), ("reward", 0.0)],
    ids=["sft-no-clip", "sft-clip", "dpo-no-clip", "dpo-clip", "reward-no-clip"],
)
@pytest.mark.slow  # 15 s on a 2-core CPU
def test_matches_stock_trainer(build, kind, max_grad_norm):
    stock = build(kind, max_grad_norm=max_grad_norm)
    stock.train()
    rapid = enable_rapidfire(build(kind, max_grad_norm=max_grad_norm), config=PARITY_CONFIG)
    rapid.train()

    opt = rapid.optimizer.optimizer  # accelerate's wrapper -> RapidFireOptimizer
    stats = opt.stats()
    assert stats["steps"] == STEPS and stats["skipped"] == 0
    if max_grad_norm == 0.0:
        # nothing predicted: every window after the first snapshot is stepped inside backward
        assert stats["pipelined_steps"] == STEPS
    else:
        # random-init gradients have norm ~3 > 1: clipping binds, so windows are deferred to step()
        assert stats["deferred_steps"].get("clip_may_bind", 0) >= 1

    base, ours = train_log(stock), train_log(rapid)
    assert len(base) == len(ours) == STEPS
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(base), rtol=LOSS_RTOL, atol=0)
    # the gradient norm the trainer logs is the optimizer's true pre-clip norm, even when pipelined
    torch.testing.assert_close(
        torch.tensor(train_log(rapid, "grad_norm")),
        torch.tensor(train_log(stock, "grad_norm")),
        rtol=1e-5,
        atol=0,
    )
    assert train_log(rapid, "learning_rate") == train_log(stock, "learning_rate")
    assert _max_param_diff(stock.model, rapid.model) <= PARAM_ATOL
    # and training changed the weights (the comparison is not between two untouched models)
    untouched = build(kind).model
    assert _max_param_diff(untouched, stock.model) > 1e-4


def test_disable_pipeline_steps_after_backward(build):
    trainer = enable_rapidfire(build("sft", max_grad_norm=0.0, max_steps=2), config=PARITY_CONFIG)
    trainer.disable_pipeline()
    trainer.train()
    stats = trainer.optimizer.optimizer.stats()
    assert stats["steps"] == 2 and stats["pipelined_steps"] == 0 and not stats["pipeline_enabled"]


def test_wraps_user_optimizer_and_scheduler(build):
    trainer = build("sft", max_steps=3, max_grad_norm=0.0)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    user_opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda step: 1.0 / (1 + step))
    trainer.optimizer, trainer.lr_scheduler = user_opt, sched  # what Trainer(optimizers=(opt, sched)) stores
    enable_rapidfire(trainer, config=PARITY_CONFIG)
    trainer.train()
    rf_opt = trainer.optimizer.optimizer
    assert rf_opt.inner is user_opt
    assert [round(lr, 6) for lr in train_log(trainer, "learning_rate")] == [0.05, 0.025, 0.016667]


def test_precision_rule_switches_the_pipeline_off(build):
    """A fallback rule's action reaches the trainer: the plugin sees the logged throughput and turns the
    pipeline off through ``trainer.disable_pipeline()`` (rules read metrics a step late, so 4 steps)."""
    config = {
        "gradient": {"pipeline": True},
        "precision": {
            "mode": "adaptive",
            "initial": "fp32",
            "fallback": [{"condition": "throughput < 1e12", "action": "disable_pipeline"}],
        },
    }
    trainer = enable_rapidfire(build("sft", max_grad_norm=0.0), config=config)
    trainer.train()
    stats = trainer.optimizer.optimizer.stats()
    assert trainer._rapidfire.pipeline is False and not stats["pipeline_enabled"]
    assert 1 <= stats["pipelined_steps"] < STEPS  # on at the start, off once the rule fired
    assert trainer._rapidfire.parts["precision"].stats()["actions"] == {"disable_pipeline": 1}
