"""PPOTrainer and memory.optimization / memory.checkpointing / memory.prefetch_window: a forced policy
checkpoints the training forwards (less activation memory, bit-exact training), no level recomputes a run
that fits, a level recomputes only when memory is short, the user's gradient_checkpointing is kept, and
prompt batches arrive prefetched in the same order with the same contents."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.memory import activation_bytes
from rapidfire_hf.ppo import PPOTrainer
from tests.ppo.helpers import ppo_args

LEVELS = ("conservative", "balanced", "aggressive")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def make_trainer(tmp_path, tok, memory: dict | None, **kw):
    torch.manual_seed(0)
    cfg = None if memory is None else {"memory": memory, "gradient": {"pipeline": False}}
    kw = {"num_ppo_epochs": 1, "max_steps": 1, **kw}
    return PPOTrainer(
        args=ppo_args(tmp_path, rapidfire_config=cfg, **kw),
        processing_class=tok,
        model=build_tiny_llama(tok),
        value_model=build_tiny_value_model(tok),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
    )


def training_forward_bytes(trainer) -> int:
    """Activation bytes of one training forward (policy and value model) on a fixed batch."""
    module = trainer.accelerator.unwrap_model(trainer.model).train()
    queries = trainer.next_prompts(0)["input_ids"]
    responses = torch.randint(3, 20, (queries.shape[0], 6), generator=torch.Generator().manual_seed(1))
    qr = torch.cat([queries, responses], dim=1)
    ctx = queries.shape[1]
    return activation_bytes(lambda: module(qr, trainer.pad_token_id, ctx, 1.0, with_entropy=True))


def test_forced_checkpointing_checkpoints_the_training_forwards_and_trains_bit_exact(tmp_path, tokenizer):
    held, weights = {}, {}
    for policy in ("off", "elementwise", "matmuls"):
        memory = {"checkpointing": policy, "planner": False, "prefetch_window": 0}
        trainer = make_trainer(tmp_path / policy, tokenizer, memory)
        trainer.train()
        assert trainer.checkpointing == (None if policy == "off" else policy)
        value_layer = trainer.accelerator.unwrap_model(trainer.model).value_model.model.layers[0]
        assert value_layer.gradient_checkpointing == (policy != "off")  # the value model too
        held[policy] = training_forward_bytes(trainer)
        weights[policy] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    assert held["off"] > held["elementwise"] > held["matmuls"], held
    for policy in ("elementwise", "matmuls"):  # recompute gives the same gradients: the same update
        for name, w in weights["off"].items():
            assert torch.equal(weights[policy][name], w), (policy, name)


@pytest.mark.parametrize("level", LEVELS)
def test_no_level_recomputes_a_run_that_fits(tmp_path, tokenizer, level):
    trainer = make_trainer(tmp_path, tokenizer, {"optimization": level})
    trainer.train()
    assert trainer.checkpointing is None and trainer.plan.checkpointing == "none" and trainer.plan.fits
    assert not trainer.policy.model.layers[0].gradient_checkpointing


def test_user_gradient_checkpointing_is_respected(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, {"optimization": "aggressive"}, gradient_checkpointing=True)
    trainer.train()
    assert trainer.checkpointing == "gradient_checkpointing"
    layer = trainer.policy.model.layers[0]
    assert layer.gradient_checkpointing
    assert "context_fn" not in getattr(layer._gradient_checkpointing_func, "keywords", {})


def test_no_rapidfire_config_no_checkpointing(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, None)
    trainer.train()
    assert trainer.checkpointing is None and not trainer.policy.model.layers[0].gradient_checkpointing


@pytest.mark.parametrize(
    ("level", "free", "expected"),
    [
        ("auto", None, None),
        ("balanced", 1, "matmuls"),
        ("aggressive", 1, "matmuls"),
        ("conservative", 1, None),
    ],
)
def test_a_level_recomputes_only_when_memory_is_short(
    tmp_path, tokenizer, monkeypatch, level, free, expected
):
    if free is not None:  # a device with (almost) no free memory left
        monkeypatch.setattr("rapidfire_hf.memory.checkpointing.free_device_bytes", lambda device: free)
    trainer = make_trainer(tmp_path, tokenizer, {"optimization": level})
    trainer.train()
    assert trainer.checkpointing == expected  # a CPU run: the host's available RAM is the budget
    assert trainer.plan.fits == (free is None)  # conservative may not recompute: it says it does not fit


def record_rollouts(trainer):
    seen = []
    rollout = trainer.rollout

    def recording(batch):
        seen.append((batch["input_ids"].clone(), trainer._prompts.fetched))
        return rollout(batch)

    trainer.rollout = recording
    return seen


def test_prefetch_same_batches_and_runs_ahead(tmp_path, tokenizer):
    runs = {}
    for window in (0, 2):
        trainer = make_trainer(tmp_path / str(window), tokenizer, {"prefetch_window": window}, max_steps=4)
        runs[window] = record_rollouts(trainer)
        trainer.train()
        assert len(runs[window]) == 4
    for (ids0, _), (ids2, _) in zip(runs[0], runs[2]):
        assert torch.equal(ids0, ids2)
    # when update k's rollout starts, the batches of updates k+1 .. k+window are already collated
    assert [fetched for _, fetched in runs[0]] == [1, 2, 3, 4]
    assert [fetched for _, fetched in runs[2]] == [3, 4, 4, 4]
