"""PPOTrainer and memory.optimization / memory.prefetch_window: the training forwards are checkpointed per
level (less activation memory, bit-exact training), the user's gradient_checkpointing is kept, ``auto``
follows free memory, and prompt batches arrive prefetched in the same order with the same contents."""

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


def test_levels_checkpoint_the_training_forwards_and_train_bit_exact(tmp_path, tokenizer):
    held, weights = {}, {}
    for level in LEVELS:
        trainer = make_trainer(tmp_path / level, tokenizer, {"optimization": level, "prefetch_window": 0})
        trainer.train()
        assert trainer.checkpointing == (None if level == "conservative" else level)
        value_layer = trainer.accelerator.unwrap_model(trainer.model).value_model.model.layers[0]
        assert value_layer.gradient_checkpointing == (level != "conservative")  # the value model too
        held[level] = training_forward_bytes(trainer)
        weights[level] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    assert held["conservative"] > held["balanced"] > held["aggressive"], held
    for level in ("balanced", "aggressive"):  # recompute gives the same gradients: the same update
        for name, w in weights["conservative"].items():
            assert torch.equal(weights[level][name], w), (level, name)


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


@pytest.mark.parametrize(("free", "expected"), [(None, "conservative"), (1, "aggressive")])
def test_auto_follows_free_memory(tmp_path, tokenizer, monkeypatch, free, expected):
    if free is not None:  # a device with (almost) no free memory left
        monkeypatch.setattr("rapidfire_hf.memory.checkpointing.free_device_bytes", lambda device: free)
    trainer = make_trainer(tmp_path, tokenizer, {"optimization": "auto"})
    trainer.train()
    assert trainer.checkpointing == expected  # a CPU run: the host's available RAM is the budget


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
