"""The kernels benchmarks in their CPU smoke modes: run.py (Triton's interpreter) writes correct attention,
sampling and skinny-matmul rows; profile_decode.py splits the step into categories, gaps and a floor;
logprobs.py matches the fp32 reference."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "run.py"
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.slow  # the interpreter runs the 7B-shaped attention tile by tile (~20 s)
def test_smoke_run_writes_results_and_every_kernel_matches_its_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--out", str(tmp_path), "--smoke"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["kernel"], r["impl"]) for r in rows} == {
        ("attention", "sdpa"),
        ("attention", "matmul"),
        ("attention", "triton"),
        ("attention", "sdpa@40"),  # mid-response: the first 40 of 64 slots filled
        ("attention", "triton@40"),
        ("attention", "triton@40+kv_end"),
        ("sampling", "torch"),
        ("sampling", "triton"),
        ("sampling", "triton-philox"),
        ("matmul", "torch"),
        ("matmul", "triton"),
    }
    # every smoke projection shape has both implementations (one of them splits K: 160 = 3 fp32 blocks)
    matmul = [r for r in rows if r["kernel"] == "matmul"]
    assert len(matmul) == 2 * 3 and all(r["batch"] == 3 for r in matmul)
    assert any(r["shape"].endswith("64x160") for r in matmul)
    for row in rows:
        assert row["ms"] > 0
        if row["max_abs_diff"] is not None:
            assert row["max_abs_diff"] < 1e-5, row
        if row.get("same_tokens") is not None:
            assert row["same_tokens"], row
    assert (tmp_path / "results.csv").stat().st_size > 0 and (tmp_path / "kernels.png").stat().st_size > 0


def test_kernel_sections_are_picked_by_name_and_unknown_ones_refused(tmp_path, capsys):
    from tests.benchmarks.loader import load_benchmark

    run = load_benchmark("kernels/run.py")
    assert run.main(["--out", str(tmp_path), "--smoke", "--kernels", "sampling"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"sampling"}
    assert run.main(["--out", str(tmp_path), "--smoke", "--kernels", "sampling,gemv"]) == 2
    assert "unknown --kernels gemv" in capsys.readouterr().err
    assert run.main(["--out", str(tmp_path), "--smoke", "--kernels", "attention", "--end", "-5"]) == 2
    assert "--end -5" in capsys.readouterr().err
    prof = load_benchmark("kernels/profile_decode.py")
    assert prof.main(["--out", str(tmp_path), "--first-step", "380", "--steps", "16"]) == 2
    assert "must lie within the response" in capsys.readouterr().err


def test_profile_smoke_splits_the_step_into_categories_gaps_and_a_floor_from_the_bytes(tmp_path):
    from tests.benchmarks.loader import load_benchmark

    prof = load_benchmark("kernels/profile_decode.py")
    assert prof.main(["--out", str(tmp_path), "--smoke"]) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["status"] == "ok" and row["window"] == "between markers", row
    per_cat = [row[f"{c}_ms"] for c in prof.CATEGORIES]
    assert sum(per_cat) == pytest.approx(row["kernel_ms"])
    # the CPU step's ops: the projections (aten::mm), SDPA, the vocabulary log-softmax / noise, the norms
    assert all(row[f"{c}_ms"] > 0 for c in ("gemm", "attention", "sampling", "norm_rope_elementwise")), row
    assert row["gap_ms"] == pytest.approx(row["wall_ms"] - row["kernel_ms"])
    assert 0 < row["kernel_ms"] <= row["span_ms"] * 1.01  # the ops lie inside the span between the markers
    # the floor is the bytes read over the bandwidth: the model's parameters (less the unread embedding
    # rows) and the K/V slots the 3 profiled steps read (prompt 8 padded to 32, + steps 3..5, bucket 64)
    shape = prof.SMOKE_SHAPES["smoke"]
    model = prof.build_model(shape, "cpu", torch.float32, 128)
    assert row["weight_bytes"] == prof.weight_read_bytes(model, 2)
    layers, kv, d = shape["num_hidden_layers"], shape["num_key_value_heads"], 64 // 4
    assert row["kv_slots"] == 40 and row["kv_bytes"] == layers * 2 * kv * d * 4 * 2 * 40
    assert row["floor_ms"] == pytest.approx(
        (row["weight_bytes"] + row["kv_bytes"]) / (row["peak_tb_s"] * 1e9)
    )
    assert row["top_kernels"] and all(k["category"] in prof.CATEGORIES for k in row["top_kernels"])
    assert (tmp_path / "results.csv").stat().st_size > 0 and (tmp_path / "profile.png").stat().st_size > 0


def test_profile_int8_variant_runs_the_8bit_cache_and_counts_its_bytes(tmp_path):
    """The ``int8`` variant builds the engine with ``kv_cache_dtype="int8"`` (its cache holds int8) and its
    floor counts one byte an element plus one fp32 scale per head vector."""
    from rapidfire_hf.rollout import RolloutEngine
    from tests.benchmarks.loader import load_benchmark

    prof = load_benchmark("kernels/profile_decode.py")
    made = []
    real = RolloutEngine.__init__

    def spy(self, *a, **kw):
        made.append(kw.get("kv_cache_dtype"))
        real(self, *a, **kw)

    RolloutEngine.__init__ = spy
    try:
        assert prof.main(["--out", str(tmp_path), "--smoke", "--variants", "default,int8"]) == 0
    finally:
        RolloutEngine.__init__ = real
    assert made == [None, "int8"]
    plain, small = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert plain["status"] == small["status"] == "ok" and small["variant"] == "int8"
    d = 64 // 4
    assert small["kv_bytes"] == pytest.approx(plain["kv_bytes"] / 4 * (1 + 4 / d))  # fp32 smoke: 4 -> 1 byte


def test_logprobs_smoke_every_implementation_matches_the_fp32_reference(tmp_path):
    from tests.benchmarks.loader import load_benchmark

    lp = load_benchmark("kernels/logprobs.py")
    assert lp.main(["--out", str(tmp_path), "--smoke"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["impl"], r["mode"], r["rows"]) for r in rows} == {
        (i, m, n) for i in lp.IMPLS for m in lp.MODES for n in (16, 24)
    }
    for row in rows:
        if row["impl"] == "liger" and row["status"].startswith("skipped"):
            assert "not installed" in row["status"]  # optional: only where liger-kernel is installed
            continue
        assert row["status"] == "ok", row
        assert row["ms"] > 0
        # fp32 on the CPU: chunking changes only the summation order
        assert row["logprobs_max_abs_err"] < 1e-5, row
        if row["mode"] == "fwd+bwd":
            assert row["grad_hidden_rel_err"] < 1e-5 and row["grad_weight_rel_err"] < 1e-5, row
        else:
            assert "grad_hidden_max_abs_err" not in row
    assert (tmp_path / "results.csv").stat().st_size > 0 and (tmp_path / "logprobs.png").stat().st_size > 0


def test_int8_attention_section_times_each_launch_against_the_dequantized_reference(tmp_path, capsys):
    """``--kernels attention_int8``: one row per ``--launches`` entry, each within fp32 rounding of the fp32
    attention over the dequantized cache (the launch changes the block order, not the arithmetic); a launch
    that is no launch is refused by name."""
    from tests.benchmarks.loader import load_benchmark

    run = load_benchmark("kernels/run.py")
    argv = ["--out", str(tmp_path), "--smoke", "--kernels", "attention_int8", "--launches", "64x4x3,32x2x2"]
    assert run.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["impl"] for r in rows if r["shape"] == "llama-7b"] == [
        "triton-int8@40+kv_end[64x4x3]",
        "triton-int8@40+kv_end[32x2x2]",
    ]
    assert all(r["max_abs_diff"] < 1e-5 for r in rows), rows
    for bad in ("64x4", "48x4x3", "64x3x3", "64x4x0", "axbxc"):
        assert run.main([*argv[:5], "--launches", bad]) == 2
        assert "--launches" in capsys.readouterr().err
