"""``benchmarks/distributed/run.sh --smoke``: the GPU script's CPU path runs end to end and reports."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # 99 s on a 2-core CPU
def test_run_sh_smoke_writes_results_and_chart(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/distributed/run.sh"), str(tmp_path), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,  # about 60-180 s on a 2-core CPU, depending on what else runs there
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {s["name"]: s["rc"] for s in results["steps"]} == {
        "optim_gloo": 0,
        "smoke_ddp": 0,
        "tput_1": 0,
        "tput_2": 0,
    }
    assert set(results["throughput"]) == {"1", "2"}
    assert results["throughput"]["2"]["tokens_per_second"] > 0 and results["speedup_2_vs_1"] > 0
    smoke = results["ppo_smoke"]["ddp"]
    assert smoke["finished"] and smoke["params_equal_across_ranks"] and smoke["updates"] == 2
    assert smoke["gradient_sync_diff"] == [0.0, 0.0]
    assert (tmp_path / "tokens_per_second.png").stat().st_size > 1000
