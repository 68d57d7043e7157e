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


def test_lora_rank_wraps_the_model_and_the_fused_lora_system_builds_its_engine():
    """--lora-rank puts a non-zero PEFT adapter on q/k/v/o; the system "+fuse_lora" runs the engine with the
    LoRA layers fused, "+fuse" without them (those layers keep their modules)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import _timing
        from run import build_model, with_lora
    finally:
        sys.path.remove(str(SCRIPT.parent))
    import torch

    model = with_lora(build_model("smoke", "cpu", torch.float32, 64), 2)
    ids = torch.randint(3, 100, (2, 4))
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(b) == 4 * 2 and all(p.abs().sum() > 0 for p in b)  # q/k/v/o of each of the 2 layers
    engines = {}
    for variant in ("fuse", "fuse_lora"):
        run = _timing._runner(model, f"ours_eager+{variant}", ids, torch.ones_like(ids))
        run(3, None)
        engines[variant] = run.engine
    assert not any(engines["fuse"]._static.net.fused)
    assert all(engines["fuse_lora"]._static.net.fused_now)
