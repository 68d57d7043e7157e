"""The GPU benchmark script's --smoke mode runs on CPU and writes its results and chart."""

from __future__ import annotations

import json
import math

from tests.bench_loader import load_benchmark


def test_benchmark_smoke(tmp_path):
    module = load_benchmark("precision/run.py")
    module.main(["--out", str(tmp_path), "--smoke"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "precision.png").stat().st_size > 0
    assert {"gpu", "torch", "date", "command"} <= set(results["env"])
    runs = results["overflow"]["runs"]
    assert runs["static_fp16"]["nonfinite_loss_steps"] == results["overflow"]["steps"]
    assert runs["adaptive_fp16"]["nonfinite_loss_steps"] == 0
    assert runs["adaptive_fp16"]["stats"]["switches"] == 1
    assert math.isclose(runs["adaptive_fp16"]["final_loss"], runs["fp32"]["final_loss"], rel_tol=0.02)
    fp8 = results["fp8"]
    assert fp8["output_rel_error_vs_bf16"] < 0.1
    assert fp8["bf16_output_finite"] and fp8["fp8_output_finite"] and fp8["fp8_cached_output_finite"]
    assert fp8["fp8_cached_ms"] > 0 and fp8["speedup_cached"] > 0
