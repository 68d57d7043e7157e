"""PPOTrainer under accelerate's FSDP2, 1 and 2 CPU processes (gloo): the rollout runs the static engine on the
policy gathered once per rollout (gather -> the engine's layout -> generate -> reshard), not model.generate."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import assert_greedy_rollout_equal, run_ranks


@pytest.mark.slow  # 15 s (1 process) and 22 s (2) on a 2-core CPU
@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp2_ppo_rollout_runs_the_engine_on_the_gathered_policy(tmp_path, nproc):
    run_ranks("ppo_fsdp2_ranks.py", tmp_path, nproc=nproc)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rank, r in enumerate(results):
        assert r["sharded_before"], rank  # FSDP2 really sharded the policy (DTensor parameters)
        assert_greedy_rollout_equal(r, rank)
        # every decode step (2 chunks x 23) ran on gathered (plain) weights: one all-gather per unit (2 layers and
        # the root) for the whole rollout, not one per chunk or per token; resharded after the rollout
        assert r["steps"] == 46 and r["gathered_every_step"], rank
        assert r["units"] == 3 and r["all_gathers"] == 3, rank
        assert r["sharded_after"], f"rank {rank}: the gathered weights were kept after the rollout"
        # one PPO update end to end with the engine's rollout
        assert r["updates"] == 1 and r["moved"] and r["finite"], rank
        assert r["policy_loss"] is not None
    assert len({r["policy_loss"] for r in results}) == 1  # every rank logs the same (reduced) loss
    line = results[0]["rollout_line"]  # the start table (rank 0) names the path and the gather
    assert "static engine (native forward; FSDP2: the policy gathered once per rollout" in line, line
