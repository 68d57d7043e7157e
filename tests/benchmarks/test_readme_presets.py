"""README.md rows 1 and 12-14 (their notes in docs/results.md, "README.md's headline rows"), and
benchmarks/presets/README.md's batch-64 and release tables, are the stored results'."""

from __future__ import annotations

import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "benchmarks" / "presets" / "results" / "h200" / "b64" / "results.csv"
CONFIG_ROWS = ("conservative", "balanced", "aggressive", "advanced", "snippet")


def _rows() -> dict[str, dict]:
    return {r["row"]: r for r in csv.DictReader(STORED.open())}


def _note(number: int) -> str:
    """docs/results.md's note on README row ``number`` (a bullet of the headline rows' section), one line."""
    text = (ROOT / "docs" / "results.md").read_text()
    section = text[text.index("## README.md's headline rows") :]
    section = section[: section.index("\n### ")]
    start = section.index(f"- **Row {number}:**")
    end = section.find("\n- ", start + 1)
    return " ".join(section[start : end if end > 0 else len(section)].split())


def _headline_notes() -> str:
    """The bullets above the per-row notes of docs/results.md's headline rows' section, one line."""
    text = (ROOT / "docs" / "results.md").read_text()
    section = text[text.index("## README.md's headline rows") :]
    return " ".join(section[: section.index("- **Row 1:**")].split())


def _cells(text: str, start: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_readme_row_12_is_the_stored_call():
    rows = _rows()
    assert all(rows[name]["status"] == "ok" for name in ("none", "trl", *CONFIG_ROWS))
    none = float(rows["none"]["tokens_per_s"])
    slowest = min(float(rows[name]["tokens_per_s"]) for name in CONFIG_ROWS)
    cells = _cells((ROOT / "README.md").read_text(), "| 12 | ")
    assert cells[2] == f"{none:,.0f}" and cells[3] == f"{slowest:,.0f}"
    assert cells[4] == f"**{slowest / none:.2f}×**"
    assert "against the slowest preset" in cells[1]
    assert f"stock TRL {float(rows['trl']['tokens_per_s']):,.0f}" in _note(12)


def test_presets_readme_table_is_the_stored_call():
    text = (ROOT / "benchmarks" / "presets" / "README.md").read_text()
    rows = _rows()
    labels = {"none": "| no config |", "balanced": "| `balanced` |", "aggressive": "| `aggressive` |",
              "conservative": "| `conservative` |", "advanced": "| `config/advanced.yaml` |",
              "snippet": "| the articles' snippet |", "aggressive-noplan": "| `aggressive`, planner off |"}  # fmt: skip
    none = float(rows["none"]["tokens_per_s"])
    for name, label in labels.items():
        cells = _cells(text, label)
        tps = float(rows[name]["tokens_per_s"])
        assert cells[1] == f"{tps:,.0f}", name
        assert cells[2].strip("*") == f"{tps / none:.2f}x", name
        assert cells[3] == f"{float(rows[name]['peak_gib']):.1f}", name
        assert cells[5].startswith(f"{rows[name]['plan_train_rows']}, {rows[name]['plan_checkpointing']}"), (
            name
        )


def _stored(folder: str) -> dict[str, dict]:
    path = ROOT / "benchmarks" / "presets" / "results" / "h200" / folder / "results.csv"
    return {r["row"]: r for r in csv.DictReader(path.open())}


def _ratio_row(number: int, rows: dict[str, dict], left: str, right: str, digits: int) -> list[str]:
    """README row ``number``'s cells, its numbers checked: stored ``left`` and ``right`` tokens/s and their
    ratio to ``digits`` decimals."""
    assert rows[left]["status"] == rows[right]["status"] == "ok"
    a, b = float(rows[left]["tokens_per_s"]), float(rows[right]["tokens_per_s"])
    cells = _cells((ROOT / "README.md").read_text(), f"| {number} | ")
    assert cells[2] == f"{a:,.0f}" and cells[3] == f"{b:,.0f}"
    assert cells[4] == f"**{b / a:.{digits}f}×**"
    return cells


def test_readme_row_13_is_the_stored_b256_call():
    rows = _stored("b256")
    assert rows["balancedscale"]["status"] == rows["trl"]["status"] == "ok"
    _ratio_row(13, rows, "none", "balanced", 2)
    note = _note(13)
    assert f"stock TRL {float(rows['trl']['tokens_per_s']):,.0f}" in note
    assert f"merges {int(rows['balanced']['plan_train_rows']) // 8} micro-batches" in note


def test_readme_row_1_is_the_stored_same_call_run():
    """Row 1: stock and our no-config run at batch 8 from one call, and the previous default (the cache
    released at every update) of the same call in the row's note in docs/results.md."""
    rows = _stored("release8")
    _ratio_row(1, rows, "trl", "none", 1)
    before = rows["none+alwaysrelease"]
    assert (
        before["status"] == "ok" and rows["none"]["batch"] == before["batch"] == rows["trl"]["batch"] == "8"
    )
    assert f"same call: {float(before['tokens_per_s']):,.0f}" in _note(1)
    speedup = float(before["s_per_update"]) / float(rows["none"]["s_per_update"])
    assert f"in row 1's call that made an update {speedup:.2f}x faster" in _headline_notes()


# benchmarks/presets/README.md's release tables: stored folder -> {row: the table's label}
RELEASE_TABLES = {
    "release8": {
        "none": "| no config |",
        "none+alwaysrelease": "| no config, `+alwaysrelease` (previous default) |",
        "balanced": "| `balanced` |",
        "balanced+alwaysrelease": "| `balanced+alwaysrelease` (previous default) |",
        "aggressive": "| `aggressive` |",
    },
    "release8_rest": {
        "none": "| no config |",
        "conservative": "| `conservative` |",
        "snippet": "| the articles' snippet |",
        "advanced": "| `config/advanced.yaml` |",
    },
}


def test_presets_readme_release_tables_are_the_stored_calls():
    text = (ROOT / "benchmarks" / "presets" / "README.md").read_text()
    section = text[text.index("## The release between scoring and training") :]
    tables = section.split("| row | s per update |")[1:]  # the release tables, in RELEASE_TABLES' order
    assert len(tables) == len(RELEASE_TABLES)
    for section, (folder, labels) in zip(tables, RELEASE_TABLES.items()):
        rows = _stored(folder)
        none = float(rows["none"]["tokens_per_s"])
        for name, label in labels.items():
            cells, row = _cells(section, label), rows[name]
            assert row["status"] == "ok", (folder, name)
            assert cells[1] == f"{float(row['s_per_update']):.3f}", (folder, name)
            assert cells[2] == f"{float(row['tokens_per_s']):,.0f}", (folder, name)
            assert cells[3].strip("*") == f"{float(row['tokens_per_s']) / none:.2f}x", (folder, name)
            assert cells[4] == f"{float(row['peak_gib']):.1f}", (folder, name)
            assert cells[5] == f"{float(row['train_s']):.3f}", (folder, name)


def test_readme_row_14_is_the_stored_7b_call():
    rows = _stored("full7b_freecache_stock")
    cells = _ratio_row(14, rows, "trl", "aggressive+freecache", 1)
    assert f"largest batch ({rows['trl']['batch']})" in cells[1]
    assert f"rollout batch ({rows['aggressive+freecache']['batch']})" in cells[1]
