"""The essential property of a sweep: each trial's results equal that trial trained alone.

Bit-exact on CPU fp32 (tolerance 0): the per-update scores, KL, losses, final adapter weights and value
head of every trial of a 3-trial sweep equal those of a 1-trial sweep with the same overrides, although
the trials differ in KL coefficient, learning rate, seed, clip range, PPO epochs and micro-batch size.

With rollout batches of 2 rows per trial, a CPU GEMM over 2 rows rounds differently from the same rows
inside the sweep's larger batch (one ulp): there the test allows 1e-5 (measured: 5e-7 on the per-update
metrics, 7.5e-8 on the adapter weights after 4 updates).
"""

from __future__ import annotations

import pytest
import torch

from .helpers import TRIALS, curves, make_sweep, max_abs_diff


@pytest.mark.usefixtures("single_thread")
def test_each_trial_equals_the_trial_alone(tokenizer, tmp_path):
    together = make_sweep(tokenizer, tmp_path / "all", TRIALS)
    results = together.train()
    assert len({tuple(curves(r)["objective/kl"]) for r in results.values()}) == 3  # the trials differ
    for name, overrides in TRIALS.items():
        alone = make_sweep(tokenizer, tmp_path / name, {name: overrides})
        result = alone.train()[name]
        assert curves(results[name]) == curves(result), f"{name}: per-update metrics differ"
        assert max_abs_diff(together.adapter_state_dict(name), alone.adapter_state_dict(name)) == 0.0
        head_a = together.trials[name].value_head.state_dict()
        head_b = alone.trials[name].value_head.state_dict()
        assert all(torch.equal(head_a[k], head_b[k]) for k in head_a)
        assert results[name].global_step == result.global_step == 3


@pytest.mark.usefixtures("single_thread")
def test_trial_order_does_not_matter(tokenizer, tmp_path):
    names = list(TRIALS)
    forward = make_sweep(tokenizer, tmp_path / "fwd", TRIALS).train()
    backward = make_sweep(tokenizer, tmp_path / "bwd", {n: TRIALS[n] for n in reversed(names)}).train()
    for name in names:
        assert curves(forward[name]) == curves(backward[name])


@pytest.mark.usefixtures("single_thread")
def test_model_generate_fallback_keeps_trials_apart(tokenizer, tmp_path, monkeypatch):
    """Models the static engine cannot run generate trial by trial through model.generate."""
    monkeypatch.setattr("rapidfire_hf.rollout.engine.choose_decode_path", lambda model: (None, "test"))
    two = {n: TRIALS[n] for n in list(TRIALS)[:2]}
    together = make_sweep(tokenizer, tmp_path / "all", two, max_steps=2)
    assert together.phases.engine.backend == "hf"
    results = together.train()
    for name, overrides in two.items():
        alone = make_sweep(tokenizer, tmp_path / name, {name: overrides}, max_steps=2).train()[name]
        assert curves(results[name]) == curves(alone)


@pytest.mark.usefixtures("single_thread")
def test_shared_reward_model(tokenizer, tmp_path):
    """One reward model scores every trial's rows in shared chunks; each trial still equals itself alone."""
    from rapidfire_hf.demo import build_tiny_reward_model

    two = {n: TRIALS[n] for n in list(TRIALS)[:2]}
    kw = dict(max_steps=2, local_rollout_forward_batch_size=6)  # chunks that straddle the trials' rows
    together = make_sweep(
        tokenizer, tmp_path / "all", two, reward_model=build_tiny_reward_model(tokenizer), **kw
    )
    results = together.train()
    for name, overrides in two.items():
        rm = build_tiny_reward_model(tokenizer)
        alone = make_sweep(tokenizer, tmp_path / name, {name: overrides}, reward_model=rm, **kw).train()[name]
        assert curves(results[name]) == curves(alone)


@pytest.mark.usefixtures("single_thread")
def test_two_row_trials_within_fp32_tolerance(tokenizer, tmp_path):
    small = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=1, num_mini_batches=1, max_steps=4
    )
    trials = {
        "a": {"kl_coef": 0.01},
        "b": {"kl_coef": 0.2, "seed": 3},
        "c": {"learning_rate": 3e-3, "seed": 7},
    }
    together = make_sweep(tokenizer, tmp_path / "all", trials, **small)
    results = together.train()
    for name, overrides in trials.items():
        alone = make_sweep(tokenizer, tmp_path / name, {name: overrides}, **small)
        ours, theirs = curves(results[name]), curves(alone.train()[name])
        for key in ours:
            assert ours[key] == pytest.approx(theirs[key], rel=0, abs=1e-5), key
        assert max_abs_diff(together.adapter_state_dict(name), alone.adapter_state_dict(name)) < 1e-5


def _mask_dims(reward_model) -> list[int]:
    """The attention-mask ranks the reward model's backbone is called with (a forward pre-hook)."""
    from rapidfire_hf.models.plumbing import classifier_parts

    dims = []
    backbone, _ = classifier_parts(reward_model, "reward_model")
    backbone.register_forward_pre_hook(
        lambda mod, args, kwargs: dims.append(kwargs["attention_mask"].dim()), with_kwargs=True
    )
    return dims


@pytest.mark.parametrize("attention, rank", [("sdpa", 4), ("eager", 2)])
def test_reward_model_gets_the_mask_its_own_attention_takes(tokenizer, tmp_path, attention, rank):
    """The 4-D mask only where the reward model itself attends through SDPA (flash attention takes only
    the 2-D one), whatever the policy uses."""
    from rapidfire_hf.demo import build_tiny_reward_model

    rm = build_tiny_reward_model(tokenizer)
    rm.set_attn_implementation(attention)
    dims = _mask_dims(rm)
    sweep = make_sweep(tokenizer, tmp_path, {"a": {}}, reward_model=rm, max_steps=1)
    assert sweep.model.config._attn_implementation == "sdpa"
    sweep.train()
    assert dims and set(dims) == {rank}
