"""PPOTrainer under accelerate's DeepSpeed ZeRO-3 plugin, 1 and 2 CPU processes (gloo, ``DS_ACCELERATOR=cpu``): the
rollout runs the static engine on the policy gathered once per rollout (one ``GatheredParameters``, no per-module
fetch while generating), partitioned again after it, and one PPO update runs.

Needs DeepSpeed (skipped without it). ``pip install deepspeed`` (0.19.8) takes 9 s here and builds no op at install;
the first run JIT-builds its CPU shared-memory comm op with the C++ compiler (~50 s, cached after)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import assert_greedy_rollout_equal, run_ranks

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install deepspeed runs this on the CPU)"
)


@pytest.mark.slow  # 15 s (1 process) and 19 s (2) on a 2-core CPU
@pytest.mark.parametrize("nproc", [1, 2])
def test_zero3_ppo_rollout_runs_the_engine_on_the_gathered_policy(tmp_path, nproc, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_ranks("ppo_zero3_ranks.py", tmp_path, nproc=nproc, timeout=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rank, r in enumerate(results):
        assert r["partitioned_before"], rank  # ZeRO-3 really partitioned the policy
        assert_greedy_rollout_equal(r, rank)
        # every decode step (2 chunks x 23) ran on whole weights: one gather of the policy for the whole rollout
        # (not one per chunk), no per-module fetch of ZeRO-3's hooks (one per layer per token); partitioned after
        assert r["steps"] == 46 and r["whole_every_step"], rank
        assert r["gathers"] == {"gathered_parameters": 1, "module_fetches": 0}, rank
        assert r["partitioned_after"], f"rank {rank}: the gathered weights were kept after the rollout"
        # one PPO update end to end with the engine's rollout
        assert r["updates"] == 1 and r["moved"] and r["finite"], rank
        assert r["policy_loss"] is not None
    assert len({r["policy_loss"] for r in results}) == 1  # every rank logs the same (reduced) loss
    line = results[0]["rollout_line"]  # the start table (rank 0) names the path and the gather
    assert "static engine (native forward; DeepSpeed ZeRO-3: the policy gathered once per rollout" in line, (
        line
    )
