"""summarize.py --same-run: each of our rows is paired only with the stock row of its own results file, and
tokens/s come from the timed updates (the first update of each row is the warm-up)."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "ppo_summarize", ROOT / "benchmarks" / "ppo_vs_trl" / "summarize.py"
)
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


def _row(system, mode, batch, times, status="ok"):
    tokens = batch * 16
    return {"part": "throughput", "system": system, "value_mode": mode, "batch": batch, "prompt_len": 4,
            "response_len": 12, "status": status, "update_times": times,
            "tokens_per_s": tokens / sorted(times[1:])[len(times[1:]) // 2], "peak_gib": 1.0}  # fmt: skip


def _write(folder: Path, name: str, rows: list[dict]) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "results.json").write_text(json.dumps({"environment": {}, "rows": rows}))


def test_pairs_only_within_a_file_and_drops_the_warmup(tmp_path):
    _write(tmp_path, "x", [_row("trl", "separate", 8, [50.0, 4.0, 2.0, 8.0]),
                           _row("rapidfire", "separate", 8, [90.0, 1.0, 0.5, 2.0]),
                           _row("rapidfire", "fused", 32, [70.0, 1.0, 1.0, 1.0])])  # fmt: skip
    _write(tmp_path, "y", [_row("trl", "separate", 32, [60.0, 8.0, 8.0, 8.0]),
                           _row("rapidfire", "fused", 64, [1.0, 1.0, 1.0], status="oom")])  # fmt: skip
    rows = summarize.same_run_summary(tmp_path)
    by = {(r["file"], r["batch"], r.get("ours")): r for r in rows}
    b8 = by[("x/results.json", 8, "separate value")]
    # stock: 128 tokens over the timed 4, 2, 8 s -> median 32, min 16, max 64 tokens/s; ours: 1, 0.5, 2 s
    assert (b8["stock_tokens_per_s"], b8["stock_min"], b8["stock_max"]) == (32.0, 16.0, 64.0)
    assert (b8["ours_tokens_per_s"], b8["ours_min"], b8["ours_max"]) == (128.0, 64.0, 256.0)
    assert b8["ratio"] == 4.0
    # our fused b32 has no stock row in its own file: no ratio, even though y holds a stock b32
    b32 = by[("x/results.json", 32, "fused value")]
    assert b32.get("ratio") is None and b32.get("stock_tokens_per_s") is None
    assert by[("y/results.json", 32, None)]["stock_tokens_per_s"] == 64.0
    assert not any(r["batch"] == 64 for r in rows)  # a failed row is not a result
    with open(tmp_path / "same_run.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows) == 3
    assert (tmp_path / "same_run.png").stat().st_size > 0


def _size7b(name, system, batch, times, status="ok"):
    return {"part": "size7b", "name": name, "system": system, "value_mode": "separate", "batch": batch,
            "status": status, "update_times": times, "tokens_per_s": 1.0, "peak_gib": 2.0}  # fmt: skip


def test_size7b_table_of_several_folders_keeps_each_rows_source(tmp_path):
    _write(tmp_path / "lora", "trl_b64", [_size7b("s7_trl_lora_b64", "trl", 64, [9.0, 3.0, 1.0, 2.0])])
    _write(
        tmp_path / "full", "ours", [_size7b("s7_rapidfire_full_b160", "rapidfire", 160, [9.0, 5.0, 4.0, 6.0])]
    )
    (tmp_path / "full" / "log.txt").write_text(  # a row whose file is not stored: its printed line
        '{"name": "s7_trl_full_b16", "status": "oom", "peak_gib": 138.8}\n'
    )
    rows = summarize.size7b_summary(tmp_path / "table", [tmp_path / "lora", tmp_path / "full"])
    by = {r["name"]: r for r in rows}
    assert set(by) == {"s7_trl_lora_b64", "s7_rapidfire_full_b160", "s7_trl_full_b16"}
    assert by["s7_trl_lora_b64"]["file"] == "lora/trl_b64/results.json"
    assert (by["s7_trl_lora_b64"]["timed_median_s"], by["s7_trl_lora_b64"]["timed_max_s"]) == (2.0, 3.0)
    assert by["s7_trl_full_b16"]["file"] == "full/log.txt" and by["s7_trl_full_b16"]["batch"] == 16
    assert (tmp_path / "table" / "summary.csv").exists() and (tmp_path / "table" / "size7b.png").exists()
