"""The GPU benchmark script's --smoke mode runs on CPU and writes its results and chart."""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.mark.slow  # 8 s on a 2-core CPU
def test_benchmark_smoke(tmp_path):
    module = load_benchmark("precision/run.py")
    module.main(["--out", str(tmp_path), "--smoke", "--fp8-loss-steps", "3"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "precision.png").stat().st_size > 0
    assert {"gpu", "torch", "date", "command", "torchao"} <= set(results["env"])
    assert set(results["seconds"]) == {"overflow", "fp8_speed", "fp8_loss"}
    runs = results["overflow"]["runs"]
    assert runs["static_fp16"]["nonfinite_loss_steps"] == results["overflow"]["steps"]
    assert runs["adaptive_fp16"]["nonfinite_loss_steps"] == 0
    assert runs["adaptive_fp16"]["stats"]["switches"] == 1
    assert math.isclose(runs["adaptive_fp16"]["final_loss"], runs["fp32"]["final_loss"], rel_tol=0.02)

    speed = results["fp8_speed"]
    assert set(speed["shapes"]) == {"llama-1.1b", "llama-7b"}
    for shape in speed["shapes"].values():
        variants = shape["variants"]
        assert list(variants)[0] == "bf16" and variants["bf16"]["speedup_vs_bf16"] == 1.0
        for name, entry in variants.items():
            if name.startswith("torchao") and "skipped" in entry:
                assert "rapidfire_hf[fp8]" in entry["skipped"]  # CI has no torchao: said so, not an error
                continue
            assert "error" not in entry, (name, entry)
            assert entry["output_finite"] and entry["ms"] > 0, name
            if name != "bf16":
                fp8 = name.startswith(("scaled_mm", "torchao"))
                assert (entry["fp8_layers"] > 0) == fp8, name
                # FP8 layers differ from bf16 by a few per cent (e4m3/e5m2), compiled bf16 by rounding only
                assert (0 < entry["layer0_rel_error"] < 0.1) if fp8 else entry["layer0_rel_error"] < 1e-2
                assert entry["grad_rel_error"] < 0.2, name
            if entry["compiled"]:
                assert entry["compiled_graphs"] == 1, name  # one graph serves every layer
                assert "speedup_vs_bf16_compiled" in entry

    loss = results["fp8_loss"]
    assert loss["steps"] == 3 and list(loss["variants"])[0] == "bf16"
    ref = loss["variants"]["bf16"]["loss"]
    assert len(ref) == 3 and all(math.isfinite(v) for v in ref)
    ran = {k: v for k, v in loss["variants"].items() if "loss" in v}
    assert "scaled_mm" in ran
    for name, entry in ran.items():
        assert entry["nonfinite_steps"] == 0 and len(entry["loss"]) == 3
        if name != "bf16":  # the same data, init and seed: FP8 stays close to bf16, and is not identical
            assert entry["fp8_layers"] > 0 and 0 < entry["max_abs_diff_vs_bf16"] < 0.05, (name, entry)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--parts", "fp9"], "--parts: unknown"),
        (["--fp8-variants", "bf16,int4"], "--fp8-variants: unknown"),
        (["--fp8-loss-variants", "bf16,int4"], "--fp8-loss-variants: unknown"),
    ],
)
def test_unknown_part_or_variant_is_refused(tmp_path, argv, match):
    module = load_benchmark("precision/run.py")
    with pytest.raises(SystemExit, match=match):
        module.main(["--out", str(tmp_path), "--smoke", *argv])
