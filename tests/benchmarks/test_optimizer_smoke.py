"""benchmarks/optimizer/run.py --smoke: runs on CPU end to end and pairs each variant with the plain torch
loop it is compared with (same micro-batches, same checkpointing), per round."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.loader import load_benchmark


def load():
    return load_benchmark("optimizer/run.py")


def test_references_pair_like_with_like():
    bench = load()
    assert bench.reference_of("rf_rollback_accum") == "torch_adamw_accum"
    assert bench.reference_of("rf_pipeline_ckpt") == "torch_adamw_ckpt"
    assert bench.reference_of("rf_clip_scale") == "torch_adamw_clip"
    assert bench.reference_of("rf_adamw8bit_pipeline") == "bnb_adamw8bit"
    assert bench.reference_of("rf_pipeline_overlap") == "torch_adamw"
    names = set(bench.variants("cpu", 2))
    assert {bench.reference_of(n) for n in names} <= names  # every reference exists


@pytest.mark.slow  # 18 s on a 2-core CPU
def test_smoke_run_writes_paired_ratios(tmp_path):
    bench = load()
    only = [
        "torch_adamw",
        "rf_pipeline_on",
        "torch_adamw_accum",
        "rf_rollback_accum",
        "torch_adamw_ckpt",
        "rf_pipeline_ckpt",
    ]
    results = bench.main(
        ["--out", str(tmp_path), "--smoke", "--rounds", "2", "--no-snapshot", "--only", *only]
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["variants"]) == set(only) and (tmp_path / "results.png").is_file()
    first, second = saved["orders"]  # the order rotates between rounds
    assert sorted(first) == sorted(second) == sorted(only) and first[0] != second[0]
    for name in only:
        v = results["variants"][name]
        assert len(v["round_ms_p50"]) == 2 and v["timed_steps"] == 2 * 2
        assert v["held_at_step_gib"] is None  # a CUDA allocator counter: not on the CPU
        if name.startswith("torch"):
            assert "vs_reference" not in v
        else:
            ref = results["variants"][bench.reference_of(name)]
            expected = sorted(a / b for a, b in zip(v["round_ms_p50"], ref["round_ms_p50"]))
            assert v["vs_reference"]["min"] == expected[0] and v["vs_reference"]["max"] == expected[-1]
    assert results["variants"]["rf_rollback_accum"]["micro_batches"] == 2
    assert results["variants"]["rf_pipeline_on"]["stats"]["pipelined_steps"] > 0


@pytest.mark.slow  # 8 s on a 2-core CPU
def test_interleaved_steps_pair_each_step_with_its_reference(tmp_path):
    bench = load()
    only = ["torch_adamw", "rf_pipeline_on", "rf_pipeline_rollback"]
    results = bench.main(
        ["--out", str(tmp_path), "--smoke", "--no-snapshot", "--only", *only, "--interleave", "5"]
    )
    inter = results["interleaved"]
    assert set(inter) == set(only)
    for name in only:
        assert len(inter[name]["times_ms"]) == 5
    for name in only[1:]:
        ref = inter[name]["vs_reference"]
        ratios = sorted(a / b for a, b in zip(inter[name]["times_ms"], inter["torch_adamw"]["times_ms"]))
        assert ref["pairs"] == 5 and ref["median"] == ratios[2]
        assert ratios[0] <= ref["median_ci95"][0] <= ref["median"] <= ref["median_ci95"][1] <= ratios[-1]
    assert inter["rf_pipeline_on"]["stats"]["pipelined_steps"] >= 5 + 1  # warm-up step + 5 timed
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["interleaved"]["rf_pipeline_rollback"]["vs_reference"]["reference"] == "torch_adamw"
