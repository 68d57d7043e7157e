"""The rollout engine on an FSDP2-sharded policy, 1 and 2 CPU processes (gloo): gathered once per rollout."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import run_ranks


@pytest.mark.slow  # 35 s (1 process) and 50 s (2) on a 2-core CPU
@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp2_policy_gathered_once_per_rollout(tmp_path, nproc):
    run_ranks("rollout_fsdp2_ranks.py", tmp_path, nproc=nproc)
    for rank in range(nproc):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["llama"]["path"] == "native" and result["gpt2"]["path"] == "generic"
        for model_type, r in result.items():
            assert r["units"] == 3, model_type  # two blocks and the root
            assert r["equal"], f"{model_type}: tokens differ from the unsharded model.generate"
            # every decode step ran on gathered (plain) weights: nothing resharded and re-gathered per token
            assert r["steps"] == 39 and r["gathered_every_step"], model_type
            assert r["sharded_after"], f"{model_type}: the gathered weights were kept after the rollout"
