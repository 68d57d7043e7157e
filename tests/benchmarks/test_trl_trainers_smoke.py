"""benchmarks/trl_trainers/run.py --smoke: stock and enable_rapidfire SFT/DPO run on CPU and are reported."""

from __future__ import annotations

import csv
import json
import math

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.mark.slow  # four child processes, each importing torch, transformers and trl (~15 s apiece on 2 cores)
def test_smoke_writes_rows_for_both_trainers_and_systems(tmp_path):
    module = load_benchmark("trl_trainers/run.py")
    # the batch search is on with a cap of 4 rows: one try for SFT (batch 2 -> 4), none for DPO (2 pairs = 4 rows)
    argv = [
        "--out",
        str(tmp_path),
        "--smoke",
        "--systems",
        "stock,rapidfire",
        "--max-batch",
        "--search-cap-rows",
        "4",
    ]
    module.main(argv)

    results = json.loads((tmp_path / "results.json").read_text())
    assert {"torch", "transformers", "trl", "accelerate"} <= set(results["environment"])
    assert "benchmarks/trl_trainers/run.py --out" in results["command"] and results["date"]
    rows = {(r["trainer"], r["system"]): r for r in results["rows"]}
    assert set(rows) == {(t, s) for t in ("sft", "dpo") for s in ("stock", "rapidfire")}
    for row in rows.values():
        assert row["status"] == "ok", row.get("log_tail")
        assert row["steps"] == 2 and len(row["loss"]) == 2
        assert all(math.isfinite(x) for x in [*row["loss"], *row["step_s"], row["tokens_per_s"]])
        assert row["tokens_per_s"] > 0
    # the data really is seq-64 rows: 64 tokens a row for SFT, two 64-token rows a pair for DPO
    assert rows["sft", "stock"]["tokens_per_step"] == 2 * 64
    assert rows["dpo", "stock"]["tokens_per_step"] == 2 * 2 * 64
    # ours is what the row says: enable_rapidfire installed its optimizer, and checkpointing is on
    assert any("RapidFireOptimizer" in part for part in rows["sft", "rapidfire"]["installed"])
    assert rows["sft", "rapidfire"]["checkpointing_on"] and rows["dpo", "rapidfire"]["checkpointing_on"]
    # same weights, data and seed in fp32: the loss curves agree within the stated CPU tolerance
    compared = {(c["trainer"], c["system"]): c for c in results["loss_comparison"]}
    assert set(compared) == {("sft", "rapidfire"), ("dpo", "rapidfire")}
    assert all(c["within_tolerance"] and c["tolerance"] == 1e-4 for c in compared.values())
    with (tmp_path / "results.csv").open() as fh:
        by_row = {(r["trainer"], r["system"]): r for r in csv.DictReader(fh)}
    assert len(by_row) == 4
    # no OOM on the CPU: the search reaches its cap, so the largest batch is a lower bound
    assert by_row["sft", "rapidfire"]["max_batch"] == ">=4" and by_row["dpo", "stock"]["max_batch"] == ">=2"
    assert [t["status"] for t in rows["sft", "stock"]["search"]["tries"]] == ["ok"]
    assert (tmp_path / "chart.png").stat().st_size > 0
