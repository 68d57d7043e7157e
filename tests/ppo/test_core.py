"""Our PPO math (rapidfire_hf.ppo.core) against stock TRL 1.12.0 PPO and against the plain formulas.

The TRL tensors come from ``tests/ppo/reference/trl112_ppo_reference.pt``, recorded by
``tests/ppo/reference/make_trl112_reference.py`` (one update of stock ``trl.experimental.ppo.PPOTrainer``,
CPU fp32, tiny models; see the JSON sidecar for the configurations and versions). No TRL needed here.

Tolerances: the same fp32 formulas on the same inputs. Element-wise ops agree bit for bit; reductions
(masked means, whitening) may sum in another order, hence atol 1e-6 on O(1) values.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rapidfire_hf.ppo import core

REF_PATH = Path(__file__).parent / "reference" / "trl112_ppo_reference.pt"
ATOL, RTOL = 1e-6, 1e-6
RUNS = ["k1", "k3", "k1_epochs2", "k1_whiten", "k3_epochs2_mb2"]


@pytest.fixture(scope="module")
def reference():
    return torch.load(REF_PATH, weights_only=True)


def assert_close(actual, expected, name, atol=ATOL, rtol=RTOL):
    """allclose that says where and by how much the tensors differ."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype == torch.bool or not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{name}: {actual} != {expected}"
        return
    diff = (actual.double() - expected.double()).abs()
    bad = diff > atol + rtol * expected.double().abs()
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{bad.numel()} elements differ, max abs diff {diff.max().item():.3e} at "
        f"{tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])}\nactual={actual}\nexpected={expected}"
    )


def test_reference_exercises_the_edge_cases(reference):
    """The recorded rollout covers the paths the math must get right (guards against a degenerate re-record)."""
    run = reference["runs"]["k1"]
    seq = run["rollout"]["sequence_lengths"]
    R = run["rollout"]["responses"].shape[1]
    eos = run["rollout"]["contain_eos_token"]
    assert (seq == R - 1).any() and (seq < R - 2).any()  # full-length and truncated responses
    assert eos.any() and (~eos).any()  # the missing-EOS penalty applies to some rows only
    assert run["scoring"]["kl"].abs().max() > 0.1  # the reference policy differs from the policy
    assert reference["runs"]["k1_epochs2"]["stats"]["pg_clipfrac_stats"].max() > 0  # clipping happened


@pytest.mark.parametrize("name", RUNS)
def test_truncation_and_sequence_lengths_match_trl(reference, name):
    run = reference["runs"][name]
    roll = run["rollout"]
    truncated = core.truncate_after_stop(roll["responses"], stop_token_id=2, pad_token_id=0)
    assert_close(truncated, roll["postprocessed_responses"], "postprocessed_responses")
    assert_close(core.first_true_indices(truncated == 0) - 1, roll["sequence_lengths"], "sequence_lengths")
    masks = core.response_masks(roll["sequence_lengths"], truncated.shape[1])
    assert_close(masks[0], run["scoring"]["padding_mask"], "padding_mask")
    assert_close(masks[1], run["scoring"]["padding_mask_p1"], "padding_mask_p1")


@pytest.mark.parametrize("name", RUNS)
def test_compute_advantages_matches_trl(reference, name):
    run = reference["runs"][name]
    cfg = run["config"]
    # The missing-EOS penalty as TRL applies it, on TRL's raw reward-model scores.
    eos = run["rollout"]["contain_eos_token"]
    scores = run["scores_raw"] - cfg["missing_eos_penalty"] * (~eos).float()
    assert_close(scores, run["scoring"]["scores"], "scores after penalty")

    out = core.compute_advantages(
        run["gen_logprobs"],
        run["ref_logprobs_raw"],
        run["values_raw"],
        scores,
        run["rollout"]["sequence_lengths"],
        kl_coef=cfg["kl_coef"],
        kl_estimator=cfg["kl_estimator"],
        gamma=cfg["gamma"],
        lam=cfg["lam"],
        whiten_rewards=cfg.get("whiten_rewards", False),
    )
    ref = run["scoring"]
    for key in (
        "logprobs",
        "ref_logprobs",
        "values",
        "kl",
        "non_score_reward",
        "rewards",
        "returns",
        "advantages",
    ):
        assert_close(getattr(out, key), ref[key], key)
    assert_close(out.padding_mask, ref["padding_mask"], "padding_mask")
    assert_close(out.padding_mask_p1, ref["padding_mask_p1"], "padding_mask_p1")


def test_k1_and_k3_runs_share_the_rollout_but_not_the_rewards(reference):
    k1, k3 = reference["runs"]["k1"], reference["runs"]["k3"]
    assert torch.equal(k1["rollout"]["query_responses"], k3["rollout"]["query_responses"])
    assert torch.equal(k1["scoring"]["logprobs"], k3["scoring"]["logprobs"])
    assert not torch.allclose(k1["scoring"]["rewards"], k3["scoring"]["rewards"])


def _micro_batches(run):
    """(epoch, mini-batch, micro-batch, row indices) in TRL's loop order."""
    cfg = run["config"]
    local_bs = cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"]
    mini_bs = local_bs // cfg["num_mini_batches"]
    micro_bs = cfg["per_device_train_batch_size"]
    for epoch, perm in enumerate(run["permutations"]):
        for m, mb_start in enumerate(range(0, local_bs, mini_bs)):
            mini = perm[mb_start : mb_start + mini_bs]
            for g, start in enumerate(range(0, mini_bs, micro_bs)):
                yield epoch, m, g, mini[start : start + micro_bs]


@pytest.mark.parametrize("name", RUNS)
def test_ppo_loss_matches_trl_micro_batch_stats(reference, name):
    run = reference["runs"][name]
    cfg, sc, mb, stats = run["config"], run["scoring"], run["microbatches"], run["stats"]
    batches = list(_micro_batches(run))
    assert len(batches) == len(mb["new_logprobs_raw"])
    for i, (e, m, g, inds) in enumerate(batches):
        out = core.ppo_loss(
            mb["new_logprobs_raw"][i],
            sc["logprobs"][inds],
            sc["advantages"][inds],
            mb["vpred_raw"][i],
            sc["values"][inds],
            sc["returns"][inds],
            sc["padding_mask"][inds],
            sc["padding_mask_p1"][inds],
            cliprange=cfg["cliprange"],
            cliprange_value=cfg["cliprange_value"],
            vf_coef=cfg["vf_coef"],
        )
        where = f"{name} epoch {e} mini-batch {m} micro-batch {g}"
        for ours, theirs in (
            ("pg_loss", "pg_loss_stats"),
            ("vf_loss", "vf_loss_stats"),
            ("pg_clipfrac", "pg_clipfrac_stats"),
            ("vf_clipfrac", "vf_clipfrac_stats"),
            ("approx_kl", "approxkl_stats"),
            ("ratio_mean", "ratio_stats"),
        ):
            assert_close(getattr(out, ours), stats[theirs][e, m, g], f"{where}: {ours}")
        assert_close(
            out.loss,
            stats["pg_loss_stats"][e, m, g] + cfg["vf_coef"] * stats["vf_loss_stats"][e, m, g],
            f"{where}: loss",
        )
        entropy = core.entropy_from_logits(mb["logits"][i] / (cfg["temperature"] + 1e-7)).mean()
        assert_close(entropy, stats["entropy_stats"][e, m, g], f"{where}: entropy", atol=1e-5)


@pytest.mark.parametrize("name", RUNS)
def test_trl_logged_averages_are_the_means_of_its_micro_batch_stats(reference, name):
    """What TRL logs is the plain mean over its [epochs, mini-batches, grad-accum] stats grid (zeros included)."""
    run = reference["runs"][name]
    logs, stats = run["logs"], run["stats"]
    pairs = {
        "policy/approxkl_avg": "approxkl_stats",
        "policy/clipfrac_avg": "pg_clipfrac_stats",
        "loss/policy_avg": "pg_loss_stats",
        "loss/value_avg": "vf_loss_stats",
        "val/clipfrac_avg": "vf_clipfrac_stats",
        "policy/entropy_avg": "entropy_stats",
        "val/ratio": "ratio_stats",
    }
    for log_key, stat_key in pairs.items():
        assert math.isclose(logs[log_key], stats[stat_key].mean().item(), rel_tol=1e-6, abs_tol=1e-7), log_key


# ----- plain formulas, written out ------------------------------------------------------------------


def test_gae_equals_explicit_double_loop():
    gen = torch.Generator().manual_seed(0)
    B, R, gamma, lam = 3, 7, 0.9, 0.8
    rewards = torch.randn(B, R, generator=gen, dtype=torch.float64)
    values = torch.randn(B, R, generator=gen, dtype=torch.float64)
    expected = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        for t in range(R):
            for k in range(t, R):  # A_t = sum_k (gamma*lam)^(k-t) * delta_k, V after the last slot = 0
                next_value = values[b, k + 1] if k + 1 < R else 0.0
                delta = rewards[b, k] + gamma * next_value - values[b, k]
                expected[b, t] += (gamma * lam) ** (k - t) * delta
    advantages, returns = core.gae(rewards, values, gamma, lam)
    torch.testing.assert_close(advantages, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(returns, expected + values, atol=1e-12, rtol=0)


def test_truncate_after_stop_hand_examples():
    responses = torch.tensor([[5, 2, 7, 2], [2, 5, 5, 5], [5, 6, 7, 8], [5, 6, 7, 2]])
    expected = torch.tensor([[5, 2, 0, 0], [2, 0, 0, 0], [5, 6, 7, 8], [5, 6, 7, 2]])
    assert torch.equal(core.truncate_after_stop(responses, stop_token_id=2, pad_token_id=0), expected)
    assert torch.equal(core.truncate_after_stop(responses, stop_token_id=None, pad_token_id=0), responses)
    # A stop token id of 0 is a real token id, not "no stop token".
    assert torch.equal(
        core.truncate_after_stop(torch.tensor([[3, 0, 4]]), stop_token_id=0, pad_token_id=9),
        torch.tensor([[3, 0, 9]]),
    )


def test_lengths_through_stop_hand_examples():
    responses = torch.tensor([[5, 2, 7, 3], [3, 5, 5, 5], [5, 6, 7, 8]])
    assert core.lengths_through_stop(responses, [2, 3]).tolist() == [2, 1, 4]  # the first of either id
    assert core.lengths_through_stop(responses, []).tolist() == [4, 4, 4]


def test_first_true_indices_and_masks_hand_examples():
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert core.first_true_indices(bools).tolist() == [1, 3, 0]
    padding_mask, padding_mask_p1 = core.response_masks(torch.tensor([0, 2, 3]), 4)
    assert padding_mask.tolist() == [[False, True, True, True], [False, False, False, True], [False] * 4]
    assert padding_mask_p1.tolist() == [[False, False, True, True], [False] * 4, [False] * 4]


def test_masked_whiten_equals_plain_statistics_of_the_selected_entries():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 3 + 2
    mask = torch.rand(4, 6, generator=gen) > 0.4
    selected = values[mask]
    mean, var = selected.mean(), selected.var(unbiased=True)  # torch.var with Bessel's correction
    whitened = core.masked_whiten(values, mask)
    torch.testing.assert_close(whitened, (values - mean) / torch.sqrt(var + 1e-8), atol=1e-12, rtol=0)
    assert abs(whitened[mask].mean().item()) < 1e-12
    assert abs(whitened[mask].std().item() - 1) < 1e-6
    kept_mean = core.masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(kept_mean, (values - mean) / torch.sqrt(var + 1e-8) + mean, atol=1e-12, rtol=0)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    r = ref - logp  # log(p_ref / p)
    torch.testing.assert_close(core.kl_estimate(logp, ref, "k1"), -r)
    torch.testing.assert_close(core.kl_estimate(logp, ref, "k3"), torch.exp(r) - 1 - r)
    assert (core.kl_estimate(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        core.kl_estimate(logp, ref, "k2")


def test_kl_shaped_rewards_put_the_score_after_the_last_token():
    B, R = 3, 4
    zeros = torch.zeros(B, R)
    scores = torch.tensor([1.0, 2.0, 3.0])
    rewards, non_score, kl = core.kl_shaped_rewards(
        scores, zeros, zeros, torch.tensor([0, 2, 3]), kl_coef=0.1
    )
    # score at sequence_length + 1, or at the last slot when the response fills all R slots
    assert rewards.tolist() == [[0, 1, 0, 0], [0, 0, 0, 2], [0, 0, 0, 3]]
    assert not non_score.any() and not kl.any()
