"""One full PPO update of rapidfire_hf.PPOTrainer against stock TRL 1.12.0 ``trl.experimental.ppo``.

The reference (``reference/trl112_ppo_reference.pt``, made by ``reference/make_trl112_reference.py``)
holds, for each configuration, the tiny models' initial weights, TRL's rollout (queries, sampled
responses and their generation log-probs), everything TRL computed from it, its per-epoch mini-batch
permutations, its per-micro-batch statistics and the policy/value weights after the update. Here our
trainer starts from the same weights, scores the same rollout and optimizes with the same
permutations, so sampling plays no part. No TRL, no network.

Tolerances (CPU, fp32). Our forwards compute the same functions as TRL's with other kernels (log-softmax
instead of logits - logsumexp, the decoder's ``last_hidden_state`` instead of ``hidden_states[-1]``),
so values differ by float rounding: scoring tensors and losses within 1e-5 absolute (O(1) quantities);
final parameters within 1e-6 absolute (each element moved ~1e-3). One exception, from Adam: its first
steps move an element by lr * g / (|g| + eps), whose slope lr * eps / (|g| + eps)^2 turns a ~1e-9 rounding
difference of a gradient within a few eps (1e-8) of zero into up to ~lr * 1e-1. Elements whose gradient
was below ADAM_ILL_CONDITIONED at some step (measured on our side) are therefore held to lr / 5; on
this data that is a handful of the ~40k (in k3, elements whose gradients are 7e-9, 1.5e-8 and 1.5e-7;
the one at 7e-9, below Adam's eps, lands 0.14 lr from TRL's with the chunked log-prob kernel, whose
per-chunk log-sum-exp and chunk-accumulated head gradients round differently from one log-softmax).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REF_DIR = Path(__file__).parent / "reference"
SCORE_ATOL = 1e-5
STAT_ATOL = 1e-5
PARAM_ATOL = 1e-6
UPDATE_RTOL = 1e-4  # norm of (ours - TRL's) update over the well-conditioned elements of a tensor
GRAD_NORM_RTOL = 1e-5
ADAM_ILL_CONDITIONED = 1e-6  # |gradient| below which Adam amplifies rounding (see the module docstring)
# Configurations whose optimizer schedule is the same in TRL and here: TRL steps the optimizer every
# `gradient_accumulation_steps` micro-batches whatever `num_mini_batches` is (with num_mini_batches=2 it
# accumulates across the two mini-batches); rapidfire_hf steps once per mini-batch, on purpose.
SAME_SCHEDULE = ["k1", "k3", "k1_epochs2", "k1_whiten"]
OTHER_SCHEDULE = ["k3_epochs2_mb2"]
STATS = {  # rapidfire_hf optimize() key -> TRL 1.12 local in PPOTrainer.train
    "approx_kl": "approxkl_stats",
    "pg_clipfrac": "pg_clipfrac_stats",
    "pg_loss": "pg_loss_stats",
    "vf_loss": "vf_loss_stats",
    "vf_clipfrac": "vf_clipfrac_stats",
    "entropy": "entropy_stats",
    "ratio": "ratio_stats",
}


@pytest.fixture(scope="module")
def reference():
    return torch.load(REF_DIR / "trl112_ppo_reference.pt", weights_only=True)


@pytest.fixture(scope="module")
def meta():
    return json.loads((REF_DIR / "trl112_ppo_reference.json").read_text())


def assert_close(actual, expected, name, atol, rtol=0.0):
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{name}:\n{actual}\n!=\n{expected}"
        return
    diff = (actual.double() - expected.double()).abs()
    bad = diff > atol + rtol * expected.double().abs()
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{bad.numel()} elements differ, max abs diff {diff.max().item():.3e}"
        f"\nactual={actual}\nexpected={expected}"
    )


def _models(reference, meta, tok):
    from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model

    m = meta["model"]
    sizes = dict(hidden=m["hidden"], layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"])
    models = {
        "policy": build_tiny_llama(tok, **sizes, initializer_range=m["initializer_range"]),
        "ref": build_tiny_llama(tok, **sizes, initializer_range=m["initializer_range"]),
        "value": build_tiny_value_model(tok, **sizes),
        "reward": build_tiny_value_model(tok, **sizes),
    }
    for role, model in models.items():
        model.load_state_dict(reference["initial"][role], strict=True)
    return models


def _trainer(reference, meta, name, tmp_path, optimizer=None):
    from rapidfire_hf.demo import build_char_tokenizer, make_prompt_dataset
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer

    tok = build_char_tokenizer()
    models = _models(reference, meta, tok)
    cfg = dict(reference["runs"][name]["config"])
    # TRL 1.12 PPO ignores max_grad_norm (never clips); ours honours it, so turn clipping off for parity.
    args = PPOConfig(output_dir=str(tmp_path), max_grad_norm=0.0, **cfg)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=models["policy"],
        ref_model=models["ref"],
        reward_model=models["reward"],
        value_model=models["value"],
        train_dataset=make_prompt_dataset(meta["num_prompts"], seed=0),
        optimizer=optimizer,
    )
    return trainer, models


def _score(trainer, run):
    from rapidfire_hf.ppo import Rollout

    roll = run["rollout"]
    rollout = Rollout(queries=roll["queries"], responses=roll["responses"], logprobs=run["gen_logprobs"])
    return trainer.score(rollout)


def _check_scoring(exp, run):
    assert_close(exp.postprocessed_responses, run["rollout"]["postprocessed_responses"], "postprocessed", 0)
    sc = run["scoring"]
    for key in ("padding_mask", "padding_mask_p1"):
        assert_close(getattr(exp.adv, key), sc[key], key, 0)
    for key in (
        "logprobs",
        "ref_logprobs",
        "values",
        "scores",
        "kl",
        "non_score_reward",
        "rewards",
        "returns",
    ):
        assert_close(getattr(exp.adv, key), sc[key], key, SCORE_ATOL)
    # whitened advantages: unit-variance values, same absolute tolerance
    assert_close(exp.adv.advantages, sc["advantages"], "advantages", SCORE_ATOL)


@pytest.mark.parametrize("name", SAME_SCHEDULE)
def test_one_update_matches_trl(reference, meta, name, tmp_path):
    run = reference["runs"][name]
    trainer, models = _trainer(reference, meta, name, tmp_path)
    exp = _score(trainer, run)
    _check_scoring(exp, run)
    grads = _record_abs_grads(trainer)
    stats = trainer.optimize(exp, permutations=[torch.as_tensor(p) for p in run["permutations"]])

    # Per-(epoch, mini-batch, micro-batch) statistics, and the logged averages TRL derives from them.
    for ours, theirs in STATS.items():
        assert_close(stats[ours], run["stats"][theirs], f"{name}: {ours}", STAT_ATOL)
    for key, stat in (("loss/policy_avg", "pg_loss"), ("loss/value_avg", "vf_loss"), ("val/ratio", "ratio")):
        assert abs(stats[stat].mean().item() - run["logs"][key]) < STAT_ATOL, key
    # Gradients at each optimizer step: Adam's update hides a uniform gradient scale (a wrong loss scale or
    # accumulation factor), so compare the total gradient norm TRL's optimizer saw.
    assert len(grads) == len(run["optimizer_steps"]), "number of optimizer steps: ours vs TRL's"
    for i, (ours, theirs) in enumerate(zip(grads, run["optimizer_steps"])):
        norm = torch.stack([g.double().square().sum() for g in ours.values()]).sum().sqrt().item()
        assert abs(norm - theirs["grad_norm"]) <= GRAD_NORM_RTOL * theirs["grad_norm"], (
            f"{name}: gradient norm at optimizer step {i}: ours {norm:.8g}, TRL {theirs['grad_norm']:.8g}"
        )
        assert len(ours) == theirs["params_with_grad"], f"{name}: parameters with a gradient at step {i}"

    # Final parameters of policy and value model.
    lr = run["config"]["learning_rate"]
    for role, model in (("policy", models["policy"]), ("value", models["value"])):
        final, initial = run["final"][role], reference["initial"][role]
        params = dict(model.named_parameters())
        assert params.keys() == final.keys()
        moved = 0
        for k, p in params.items():
            ill = torch.zeros_like(p, dtype=torch.bool)
            for step in grads:  # a parameter without a gradient at a step counts as |g| = 0
                ill |= step.get(id(p), torch.zeros_like(p)) < ADAM_ILL_CONDITIONED
            ours = p.detach()
            tol = torch.where(ill, lr / 5, PARAM_ATOL)
            diff = (ours - final[k]).abs()
            assert (diff <= tol).all(), (
                f"{name}: {role}.{k}: {int((diff > tol).sum())} elements differ, max abs diff {diff.max():.3e} "
                f"({int(ill.sum())} Adam-ill-conditioned elements held to {lr / 5:g}, the others to {PARAM_ATOL:g})"
            )
            d_ours, d_trl = (ours - initial[k])[~ill], (final[k] - initial[k])[~ill]
            if d_trl.numel() and d_trl.abs().max() > 0:
                moved += 1
                rel = (d_ours - d_trl).norm() / d_trl.norm()
                assert rel < UPDATE_RTOL, f"{name}: {role}.{k} update differs by {rel:.2e} (relative)"
        assert moved > len(final) // 2, f"{name}: TRL's update moved only {moved}/{len(final)} {role} tensors"


def _record_abs_grads(trainer) -> list[dict]:
    """Per optimizer step, ``{id(parameter): |grad|}`` as the optimizer sees it (test-side instrumentation)."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    steps: list[dict] = []

    def hook(opt, args, kwargs):
        steps.append(
            {
                id(p): p.grad.detach().abs()
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            }
        )

    optimizer.register_step_pre_hook(hook)
    return steps


@pytest.mark.parametrize("name", OTHER_SCHEDULE)
def test_scoring_and_first_micro_batch_match_trl_when_schedules_differ(reference, meta, name, tmp_path):
    """With num_mini_batches > 1 only what precedes the first optimizer step is comparable."""
    run = reference["runs"][name]
    trainer, _ = _trainer(reference, meta, name, tmp_path)
    exp = _score(trainer, run)
    _check_scoring(exp, run)
    stats = trainer.optimize(exp, permutations=[torch.as_tensor(p) for p in run["permutations"]])
    for ours, theirs in STATS.items():
        assert_close(
            stats[ours][0, 0, 0], run["stats"][theirs][0, 0, 0], f"{name}: {ours}[0, 0, 0]", STAT_ATOL
        )


def test_rapidfire_optimizer_with_gradient_pipeline_keeps_trl_parity(reference, meta, tmp_path):
    """The same update through RapidFireOptimizer (per-parameter AdamW steps inside backward): two steps.

    On this run no element is Adam-ill-conditioned (plain AdamW matches TRL to 1.2e-7), so every element
    is held to PARAM_ATOL.
    """
    from rapidfire_hf import RapidFireOptimizer

    name = "k1_epochs2"
    run = reference["runs"][name]
    cfg = run["config"]
    optimizer = RapidFireOptimizer(
        lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"], gradient_pipeline=True
    )
    trainer, models = _trainer(reference, meta, name, tmp_path, optimizer=optimizer)
    stats = trainer.optimize(
        _score(trainer, run), permutations=[torch.as_tensor(p) for p in run["permutations"]]
    )
    for ours, theirs in STATS.items():
        assert_close(stats[ours], run["stats"][theirs], f"pipeline {name}: {ours}", STAT_ATOL)
    for role in ("policy", "value"):
        for k, p in models[role].named_parameters():
            assert_close(p, run["final"][role][k], f"pipeline {name}: {role}.{k}", PARAM_ATOL)
