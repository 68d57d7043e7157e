"""benchmarks/ppo_vs_trl: the speed-up variants of our trainer (--ours-*), their names and knobs, and the
merge / summary of rows with those names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.loader import load_benchmark

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ppo_vs_trl"
run = load_benchmark("ppo_vs_trl/run.py", keep_on_path=True)
worker = load_benchmark("ppo_vs_trl/worker.py")


def _rows(*argv):
    return run.configs(run.parse_args(["--out", "x", "--part", "throughput", *argv]))


def test_default_rows_keep_their_names_and_settings():
    rows = _rows()
    assert [r["name"] for r in rows] == [
        "tp_trl_b8",
        "tp_trl_b32",
        "tp_trl_b64",
        "tp_rapidfire_b8",
        "tp_rapidfire_b32",
        "tp_rapidfire_b64",
        "tp_rapidfire_b256",
        "tp_fused_b64",
        "tp_fused_b256",
    ]
    ours = [r for r in rows if r["system"] == "rapidfire"]
    assert all(r["variant"] == "base" and r["micro"] == 8 for r in ours)
    assert all(worker.speedup_args(r) == {} for r in rows)  # PPOConfig exactly as before


def test_variants_name_and_record_their_knobs():
    rows = _rows(
        "--trl-batches", "64", "--our-batches", "256", "--fused-batches", "256",
        "--ours-variants", "base,liger,compile,liger+compile,m32", "--fused-variants", "compile+m32",
    )  # fmt: skip
    by_name = {r["name"]: r for r in rows}
    assert list(by_name) == [
        "tp_trl_b64",
        "tp_rapidfire_b256",
        "tp_rapidfire_b256_liger",
        "tp_rapidfire_b256_compile",
        "tp_rapidfire_b256_liger_compile",
        "tp_rapidfire_b256_m32",
        "tp_fused_b256_compile_m32",
    ]
    assert by_name["tp_trl_b64"]["micro"] == 8 and "variant" not in by_name["tp_trl_b64"]  # TRL: --micro
    fused = by_name["tp_fused_b256_compile_m32"]
    assert (fused["micro"], fused["variant"], fused["liger"], fused["compile"]) == (
        32,
        "compile+m32",
        False,
        True,
    )
    assert worker.speedup_args(by_name["tp_rapidfire_b256_liger_compile"]) == {
        "use_liger_kernel": True,
        "torch_compile": True,
    }
    cfg = {
        **fused,
        "rollout_decode_mode": "cuda_graph",
        "compile_backend": "inductor",
        "compile_mode": "max-autotune",
    }
    assert worker.speedup_args(cfg) == {
        "rollout_decode_mode": "cuda_graph",
        "torch_compile": True,
        "torch_compile_backend": "inductor",
        "torch_compile_mode": "max-autotune",
    }
    args = {**worker.common_args({**fused, "part": "throughput"}, "cpu"), **worker.speedup_args(fused)}
    assert args["per_device_train_batch_size"] == 32 and args["gradient_accumulation_steps"] == 8


def test_single_switches_and_bad_input():
    (row,) = _rows(
        "--trl-batches",
        "",
        "--our-batches",
        "64",
        "--fused-batches",
        "",
        "--ours-liger",
        "--ours-micro",
        "16",
    )
    assert row["name"] == "tp_rapidfire_b64_liger_m16" and row["micro"] == 16 and row["liger"]
    with pytest.raises(SystemExit):
        run.parse_args(["--out", "x", "--ours-liger", "--ours-variants", "base"])
    with pytest.raises(SystemExit):
        run.parse_args(["--out", "x", "--ours-variants", "base,fast"])
    smoke = run.configs(
        run.parse_args(["--out", "x", "--smoke", "--part", "throughput", "--ours-variants", "compile+m32"])
    )
    ours = [r for r in smoke if r["system"] == "rapidfire"]
    # the smoke batch is 8: the micro-batch is capped there (and named by what runs); CPU compile: aot_eager
    assert {r["name"] for r in ours} == {"tp_rapidfire_b8_compile_m8", "tp_fused_b8_compile_m8"}
    assert all(r["compile_backend"] == "aot_eager" for r in ours)


@pytest.mark.slow  # 6 s on a 2-core CPU
def test_merge_and_summary_keep_variants_apart(tmp_path):
    base = {
        "part": "throughput",
        "system": "rapidfire",
        "value_mode": "separate",
        "batch": 256,
        "status": "ok",
        "peak_gib": 30.0,
    }
    rows = [
        {**base, "name": "tp_rapidfire_b256", "variant": "base", "tokens_per_s": 100.0},
        {
            **base,
            "name": "tp_rapidfire_b256_liger_compile",
            "variant": "liger+compile",
            "tokens_per_s": 150.0,
        },
    ]
    for i, row in enumerate(rows):
        (tmp_path / f"run{i}.json").write_text(
            json.dumps({"environment": {"command": f"c{i}"}, "rows": [row]})
        )
    out = tmp_path / "merged"
    subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "merge", str(out), str(tmp_path / "run0.json"), str(tmp_path / "run1.json")],
        check=True,
    )  # fmt: skip
    merged = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in merged] == [r["name"] for r in rows]
    assert "variant" in (out / "results.csv").read_text().splitlines()[0]
    subprocess.run([sys.executable, str(BENCH / "summarize.py"), "--results", str(out)], check=True)
    summary = (out / "summary.csv").read_text().splitlines()
    assert summary[0].split(",")[:3] == ["system", "value_mode", "variant"]
    assert [line.split(",")[2] for line in summary[1:]] == ["base", "liger+compile"]


def test_decode_kernels_reach_ppo_config():
    """--ours-decode-kernels names our rows and becomes PPOConfig's decode fields; TRL rows stay stock."""
    rows = _rows(
        "--trl-batches",
        "8",
        "--our-batches",
        "8",
        "--fused-batches",
        "",
        "--ours-decode-kernels",
        "fuse+triton",
    )
    by_name = {r["name"]: r for r in rows}
    assert list(by_name) == ["tp_trl_b8", "tp_rapidfire_b8_fuse_triton"]
    assert worker.speedup_args(by_name["tp_rapidfire_b8_fuse_triton"]) == {
        "rollout_decode_fuse_projections": True,
        "rollout_decode_attention": "triton",
        "rollout_decode_sampler": "triton",
    }
    assert worker.speedup_args(by_name["tp_trl_b8"]) == {}
    fuse_only = {r["name"]: r for r in _rows("--our-batches", "8", "--ours-decode-kernels", "fuse")}
    assert worker.speedup_args(fuse_only["tp_rapidfire_b8_fuse"]) == {"rollout_decode_fuse_projections": True}
