"""README.md's PPO numbers are the stored results': rows 2-4 from the same-run files of
benchmarks/ppo_vs_trl/results/h200/, and the 7B table (docs/results.md, "7B") and README's 7B ratios from
size7b_table/summary.csv (row 1: tests/benchmarks/test_readme_presets.py). A re-run that changes a
stored file, or a README or docs edit, that leaves the two apart fails here."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "benchmarks" / "ppo_vs_trl" / "results" / "h200"
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "docs" / "results.md").read_text()  # the 7B tables' home


def _row(number: int) -> list[str]:
    line = next(x for x in README.splitlines() if x.startswith(f"| {number} | "))
    return [c.strip() for c in line.strip("|").split("|")]


def _ints(cell: str) -> list[int]:
    return [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?![\d.]*×)", cell)]


def _same_run() -> list[dict]:
    with open(H200 / "table_1b" / "same_run.csv") as fh:
        return list(csv.DictReader(fh))


def _pair(file: str, batch: int, ours: str) -> dict:
    return next(
        r for r in _same_run() if r["file"] == file and r["batch"] == str(batch) and r["ours"] == ours
    )


def test_rows_2_and_3_are_table_1b():
    for number, pairs in ((2, [("a/results.json", 32, "separate value")]),
                          (3, [("a/results.json", 64, "separate value"), ("c/results.json", 64, "fused value")])):  # fmt: skip
        _, _, stock, ours, ratio = _row(number)
        rows = [_pair(*p) for p in pairs]
        assert _ints(stock) == [round(float(r["stock_tokens_per_s"])) for r in rows], number
        assert _ints(ours) == [round(float(r["ours_tokens_per_s"])) for r in rows], number
        shown = [float(x) for x in re.findall(r"([\d.]+)×", ratio)]
        assert shown == [round(float(r["ratio"]), 1) for r in rows], number


def test_row_4_is_best_b256():
    rows = {r["name"]: r for r in json.loads((H200 / "best_b256" / "results.json").read_text())["rows"]}
    stock, ours = rows["tp_trl_b256"], rows["tp_fused_b256_liger_compile"]
    _, _, s, o, ratio = _row(4)
    assert _ints(s) == [round(stock["tokens_per_s"])] and _ints(o) == [round(ours["tokens_per_s"])]
    assert f"{ours['tokens_per_s'] / stock['tokens_per_s']:.2f}×" in ratio


def _size7b() -> list[dict]:
    with open(H200 / "size7b_table" / "summary.csv") as fh:
        return [r for r in csv.DictReader(fh) if r["status"] == "ok"]


def _size7b_ratios(stored: list[dict]) -> tuple[float, float]:
    """(LoRA, full fine-tuning): ours fused at its largest batch against stock at its own, each from one call."""
    by = {(r["file"].split("/")[0], r["name"]): float(r["tokens_per_s"]) for r in stored}
    lora = by["size7b_lora_rm", "s7_fused_lora_b256"] / by["size7b_lora_rm", "s7_trl_lora_b64"]
    full = by["size7b_full_b4", "s7_fused_full_b160"] / by["size7b_full_b4", "s7_trl_full_b4"]
    return lora, full


def test_7b_table_is_size7b_table():
    start = RESULTS.index("**7B PPO on one H200**")
    table = RESULTS[start : RESULTS.index("\n\n", RESULTS.index("| mode |", start))]
    stored = _size7b()
    shown = re.findall(r"batch (\d+): ([\d,]+) tok/s, ([\d.]+) GiB", table)
    assert len(shown) == 7
    for batch, tps, gib in shown:
        assert any(
            r["batch"] == batch
            and round(float(r["tokens_per_s"])) == int(tps.replace(",", ""))
            and f"{float(r['peak_gib']):.1f}" == gib
            for r in stored
        ), (batch, tps, gib)
    ratios = re.findall(r"\*\*([\d.]+)×\*\*", table)
    lora, full = _size7b_ratios(stored)
    assert ratios == [f"{lora:.1f}", f"{full:.1f}"]


def test_readme_7b_paragraph_is_size7b_table():
    """README's 7B paragraph (below the headline table) repeats the 7B table's two ratios."""
    start = README.index("**7B PPO** (")
    text = " ".join(README[start : README.index("\n\n", start)].split())
    stored = _size7b()
    lora, full = _size7b_ratios(stored)
    batch = {(r["file"].split("/")[0], r["name"]): r["batch"] for r in stored}
    ours, stock = batch["size7b_full_b4", "s7_fused_full_b160"], batch["size7b_full_b4", "s7_trl_full_b4"]
    assert (
        f"**{full:.1f}×** stock TRL in full fine-tuning (batch {ours} against stock's largest, {stock})"
        in text
    )
    ours, stock = batch["size7b_lora_rm", "s7_fused_lora_b256"], batch["size7b_lora_rm", "s7_trl_lora_b64"]
    assert f"**{lora:.1f}×** with LoRA r=16 (batch {ours} against {stock})" in text
