"""benchmarks/rollout/run.py --smoke writes its three result files with sane numbers."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout" / "run.py"
pytestmark = pytest.mark.usefixtures("single_thread")  # as every rollout test (tests/conftest.py)


@pytest.mark.slow  # ~10 s of it is importing transformers' Llama + matplotlib in a fresh process state
def test_smoke_run_writes_results(tmp_path, monkeypatch):
    argv = [
        str(SCRIPT),
        "--out",
        str(tmp_path),
        "--smoke",
        "--batches",
        "2",
        "--systems",
        "ours_eager,hf_dynamic,ours_cuda_graph",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert (
        result["complete"] is True
    )  # rewritten after each row with complete=False, and once more at the end
    assert result["correctness_fp32"]["greedy_token_match_rate"] == 1.0
    assert result["correctness_fp32"]["logprob_vs_fresh_forward_max_abs"] < 1e-5
    by_system = {r["system"]: r for r in result["results"]}
    assert by_system["ours_eager"]["status"] == "ok" and by_system["ours_eager"]["ms_per_step"] > 0
    assert by_system["ours_cuda_graph"]["status"] == "skipped: needs CUDA"
    assert (tmp_path / "results.csv").stat().st_size > 0 and (tmp_path / "results.png").stat().st_size > 0
