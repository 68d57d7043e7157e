"""PPOTrainer on 2 CPU processes (gloo, DDP): a couple of updates, identical parameters on both ranks."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.launch import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_ddp")
    run_ranks("ppo_ranks.py", out, "--updates", "2")
    return [torch.load(out / f"ppo_rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow  # 23 s on a 2-core CPU
def test_parameters_identical_across_ranks(ranks):
    a, b = ranks[0]["params"], ranks[1]["params"]
    assert a.numel() > 10_000 and torch.isfinite(a).all()
    assert torch.equal(a, b)


def test_training_ran_and_moved_the_parameters(ranks):
    history = ranks[0]["history"]
    assert [h["step"] for h in history if "loss/policy_avg" in h] == [1, 2]
    assert ranks[0]["optimizer_stats"]["steps"] == 2  # 1 mini-batch x 1 epoch per update
    assert ranks[0]["optimizer_stats"]["deferred_steps"] == {"distributed": 2}
    assert all(math.isfinite(h["loss/value_avg"]) for h in history if "loss/value_avg" in h)


def test_sync_debug_logged_every_optimizer_step(ranks):
    logged = [h["gradient_sync_diff"] for h in ranks[0]["history"] if "gradient_sync_diff" in h]
    assert logged == [0.0, 0.0]
    reports = ranks[0]["sync_reports"]
    assert len(reports) == 4  # gradients before, parameters after each of the 2 steps
    assert all(r["mismatches"] == [] for r in reports)
    assert reports[0]["compared"] > reports[1]["compared"]  # the pre-step check saw gradients too


def test_engine_message(ranks):
    engine = ranks[0]["engine"]
    assert engine["engine"] == "ddp" and engine["world_size"] == 2
    assert engine["features"]["gradient_pipeline"]["status"] == "falls back"
    assert engine["features"]["rollback"]["status"] == "holds"


@pytest.mark.slow  # 25 s on a 2-core CPU
def test_the_throughput_plan_is_the_same_on_every_rank(tmp_path):
    """With a rapidfire config the planner merges the two micro-batches of a window into one forward; every
    rank runs rank 0's plan (a different number of backward passes per window would hang DDP)."""
    # rank 1 alone would plan recompute and the user's split (it sees no free memory)
    run_ranks("ppo_ranks.py", tmp_path, "--updates", "2", "--rapidfire-config", "balanced", "--squeeze-rank1")
    a, b = (torch.load(tmp_path / f"ppo_rank{r}.pt", weights_only=False) for r in range(2))
    assert a["plan"] == b["plan"] and a["plan"]["merge"] == 2 and a["plan"]["train_rows"] == 4
    assert torch.equal(a["params"], b["params"]) and torch.isfinite(a["params"]).all()
