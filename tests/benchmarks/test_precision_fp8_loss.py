"""benchmarks/precision: the FP8 training run with compiled decoder layers and bf16 weights, on CPU.

Compiled variants there use torch.compile's "eager" backend (dynamo traces, no inductor build), so a
compiled bf16 run must reproduce the eager bf16 run's losses: observed bit-identical (difference 0.0) on
torch 2.13 CPU, in bf16 and fp32 weights; the check allows 1e-6.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.benchmarks.loader import load_benchmark

COMPILED_VS_EAGER_TOL = 1e-6


@pytest.fixture(scope="module")
def run_module():
    return load_benchmark("precision/run.py")


def _ran(loss: dict) -> dict:
    return {k: v for k, v in loss["variants"].items() if "loss" in v}


@pytest.mark.slow  # 7 s on a 2-core CPU
def test_compiled_loss_run_bf16_weights(tmp_path, run_module):
    steps = 3
    run_module.main(
        [
            "--out",
            str(tmp_path),
            "--smoke",
            "--parts",
            "fp8_loss",
            "--fp8-loss-variants",
            "bf16_compiled,scaled_mm_compiled,torchao_tensorwise_compiled,bf16",
            "--fp8-loss-weights",
            "bf16",
            "--fp8-loss-steps",
            str(steps),
            "--fp8-loss-batch",
            "1",
            "--fp8-loss-seq",
            "16",
        ]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "precision.png").stat().st_size > 0
    loss = results["fp8_loss"]
    assert loss["weights"] == "bf16" and "bf16 weights" in loss["setup"]
    assert (loss["steps"], loss["batch"], loss["seq"], loss["tokens_per_step"]) == (steps, 1, 16, 16)
    # the references run first; eager bf16 is the loss reference when it runs
    assert list(loss["variants"])[:2] == ["bf16", "bf16_compiled"] and loss["reference"] == "bf16"
    ran = _ran(loss)
    assert {"bf16", "bf16_compiled", "scaled_mm_compiled"} <= set(ran)
    for name, entry in ran.items():
        assert entry["param_dtype"] == "bfloat16", name  # the weights option did store bf16 parameters
        assert len(entry["loss"]) == steps and all(math.isfinite(v) for v in entry["loss"]), name
        assert entry["nonfinite_steps"] == 0 and len(entry["step_ms"]) == steps
        # compiled: steps 1-2 (compilation) left out of the median; eager: step 1
        assert entry["warmup_steps"] == (2 if entry["compiled"] else 1), name
        assert entry["warmup_s"] > 0 and entry["median_step_ms"] > 0
        tokens = loss["batch"] * loss["seq"]
        assert math.isclose(entry["tokens_per_s"], tokens / (entry["median_step_ms"] / 1e3), rel_tol=1e-9)
        assert entry["peak_gib"] is None  # CPU: no CUDA peak
        assert "speedup_vs_bf16" in entry
        if entry["compiled"]:
            assert entry["compile_backend"] == "eager" and "speedup_vs_bf16_compiled" in entry, name
            assert entry["compiled_graphs"] == 1, name  # one graph for every decoder layer, no break

    eager, compiled = ran["bf16"], ran["bf16_compiled"]
    assert eager["max_abs_diff_vs_bf16"] == 0.0 and eager["fp8_layers"] == 0 == compiled["fp8_layers"]
    diffs = [abs(a - b) for a, b in zip(compiled["loss"], eager["loss"])]
    assert max(diffs) <= COMPILED_VS_EAGER_TOL, diffs
    assert compiled["max_abs_diff_vs_reference"] == max(diffs)

    # FP8 (emulated on CPU) compiled: FP8 layers in the graph, close to bf16 but not equal
    fp8 = ran["scaled_mm_compiled"]
    assert fp8["fp8_layers"] > 0 and 0 < fp8["max_abs_diff_vs_reference"] < 0.05, fp8
    ao = loss["variants"]["torchao_tensorwise_compiled"]
    if "skipped" in ao:  # CI has no torchao: the reason is recorded, not an error
        assert "rapidfire_hf[fp8]" in ao["skipped"]
    else:
        assert ao["fp8_layers"] > 0 and ao["nonfinite_steps"] == 0, ao


def test_fp8_skipped_without_fp8_hardware_reference_bf16_compiled(run_module):
    """The 7B command's variant list (no eager bf16) outside smoke mode on CPU: the FP8 variant is skipped
    with the hardware reason, the compiled bf16 run is the reference."""
    bench = run_module.bench_fp8
    loss = bench.run_loss(
        False,
        torch.device("cpu"),
        ("bf16_compiled", "torchao_tensorwise_compiled"),
        steps=2,
        shape_name="smoke",
        batch=2,
        seq=16,
    )
    assert loss["reference"] == "bf16_compiled" and list(loss["variants"]) == [
        "bf16_compiled",
        "torchao_tensorwise_compiled",
    ]
    assert loss["fp8_available"] is False and "CUDA GPU" in loss["fp8_unavailable_reason"]
    assert loss["variants"]["torchao_tensorwise_compiled"] == {"skipped": loss["fp8_unavailable_reason"]}
    ref = loss["variants"]["bf16_compiled"]
    assert ref["param_dtype"] == "float32" and loss["weights"] == "fp32"  # default: fp32 master weights
    assert ref["compile_backend"] == "eager"  # CPU: no inductor build
    assert ref["max_abs_diff_vs_reference"] == 0.0 and "max_abs_diff_vs_bf16" not in ref
    assert ref["speedup_vs_bf16_compiled"] == 1.0 and "speedup_vs_bf16" not in ref
    assert all(math.isfinite(v) for v in ref["loss"]) and len(ref["loss"]) == 2


def test_loss_plan(run_module):
    plan = run_module.bench_fp8.loss_plan
    assert plan(["torchao_rowwise_compiled"]) == (
        ["bf16_compiled", "torchao_rowwise_compiled"],
        "bf16_compiled",
    )
    assert plan(["scaled_mm", "torchao_tensorwise_compiled"]) == (
        ["bf16", "bf16_compiled", "scaled_mm", "torchao_tensorwise_compiled"],
        "bf16",
    )
    assert plan(["scaled_mm"]) == (["bf16", "scaled_mm"], "bf16")  # the eager-only run as before
    with pytest.raises(ValueError, match="unknown or no loss variants"):
        plan(["bf16", "int4"])


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--fp8-loss-batch", "0"], "--fp8-loss-batch: must be positive"),
        (["--fp8-loss-seq", "-8"], "--fp8-loss-seq: must be positive"),
        (["--fp8-loss-shape", "llama-9b"], "--fp8-loss-shape: unknown"),
        (["--fp8-loss-weights", "fp16"], "2"),  # argparse's choices: usage error, exit status 2
    ],
)
def test_bad_loss_options_are_refused(tmp_path, run_module, argv, match, capsys):
    with pytest.raises(SystemExit, match=match):
        run_module.main(["--out", str(tmp_path), "--smoke", "--parts", "fp8_loss", *argv])
    if argv[0] == "--fp8-loss-weights":
        assert "invalid choice: 'fp16'" in capsys.readouterr().err
