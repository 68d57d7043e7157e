"""The rollout engine on a DeepSpeed ZeRO-3 policy, 1 and 2 CPU processes (gloo): inside PPO's gather of the
policy (once per rollout) it runs and equals the unsharded model; outside it, it is refused by name.

Needs DeepSpeed (skipped without it; ``DS_BUILD_OPS=0 pip install deepspeed`` runs it on the CPU with
``DS_ACCELERATOR=cpu``)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import run_ranks

pytest.importorskip("deepspeed")


@pytest.mark.slow  # 25 s (2 processes) on a 2-core CPU
@pytest.mark.parametrize("nproc", [1, 2])
def test_zero3_policy_runs_the_engine_inside_the_gather(tmp_path, nproc, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_ranks("rollout_zero3_ranks.py", tmp_path, nproc=nproc, timeout=300)
    for rank in range(nproc):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["partitioned"], rank  # ZeRO-3 really partitioned the policy
        assert "ZeRO-3 partitions the weights and they are not gathered now" in result["refused"], rank
        first, second = result["rollouts"]
        assert first["tokens"] != second["tokens"], f"rank {rank}: the training step changed nothing"
        for r in (first, second):
            assert r["path"] == "native" and r["equal"], f"rank {rank}: tokens differ from model.generate"
            assert r["steps"] == 29 and r["whole_every_step"], rank
            assert r["partitioned_after"], f"rank {rank}: the gathered weights were kept after the rollout"
