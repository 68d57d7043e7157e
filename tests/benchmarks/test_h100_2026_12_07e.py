"""The numbers written from the fifth 2026-12-07 H100 session are the stored files': 7B full fine-tuning at
batch 160 with the frozen models as given and in 8-bit (benchmarks/card80/results/h100_2026-12-07e/frozen8,
its README section, docs/ppo.md and docs/results.md) and the families' GPU tests (families_gpu). A re-run that changes a
stored file, or an edit that leaves text and file apart, fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.benchmarks.readme_text import section as _section
from tests.benchmarks.readme_text import table as _table
from tests.benchmarks.readme_text import timing_cells

ROOT = Path(__file__).resolve().parents[2]
CALL = ROOT / "benchmarks" / "card80" / "results" / "h100_2026-12-07e"
TITLE = "fifth session"
GIB = 2**30


def _rows() -> dict[str, dict]:
    data = json.loads((CALL / "frozen8" / "results.json").read_text())
    assert "H100 80GB" in data["environment"]["gpu"]
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"full7b_offload", "full7b_frozen8"}
    assert all(r["status"] == "ok" and r["updates"] == 3 and r["batch"] == 160 for r in rows.values())
    return rows


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_table_is_the_stored_call():
    rows = _rows()
    table = _table(_section("benchmarks/card80/README.md", TITLE), "row")
    assert [t[0] for t in table] == ["full7b_offload", "full7b_frozen8"]
    for name, _, s, gen, score, train, tps, ooms, scoring, training in table:
        r = rows[name]
        assert (s, gen, score, train, tps, ooms) == timing_cells(r), name
        planned = r["plan"]["phase_peak_bytes"]
        assert scoring == f"{planned['scoring'] / GIB:.1f} / {r['phase_peak_gib']['scoring'][-1]:.1f}", name
        assert training == f"{planned['training'] / GIB:.1f} / {r['phase_peak_gib']['training'][-1]:.1f}", (
            name
        )
    # the row is what it says: both frozen models in 8-bit, the defaults row as given
    assert (rows["full7b_frozen8"]["ref_quant"], rows["full7b_frozen8"]["reward_quant"]) == ("8bit", "8bit")
    assert "ref_quant" not in rows["full7b_offload"]
    assert (
        rows["full7b_offload"]["plan"]["offload_frozen"]
        and not rows["full7b_offload"]["plan"]["offload_state"]
    )
    assert (
        rows["full7b_frozen8"]["plan"]["offload_state"]
        and not rows["full7b_frozen8"]["plan"]["offload_frozen"]
    )
    assert rows["full7b_frozen8"]["plan"]["checkpointing"] == "elementwise"


def test_what_the_text_says_of_the_rows():
    rows = _rows()
    text = _flat(_section("benchmarks/card80/README.md", TITLE))
    base, q8 = rows["full7b_offload"], rows["full7b_frozen8"]
    assert f"**{q8['tokens_per_s'] / base['tokens_per_s']:.2f}x** tokens/s" in text
    assert f"({q8['tokens_per_s']:,.0f} against {base['tokens_per_s']:,.0f} on the same machine)" in text
    assert f"takes {q8['score_s']:.1f} s against {base['score_s']:.1f}" in text
    assert f"(training {q8['train_s']:.1f} s against {base['train_s']:.1f})" in text
    freed = re.search(r"([\d.]+) GiB away outside scoring", base["plan"]["reasons"]["offload_frozen"]).group(
        1
    )
    assert f"frees {freed} GiB outside scoring" in text
    gens = [f"{g:.1f}" for g in q8["gen_times"][1:]]
    assert f"Generation took {gens[0]} and {gens[1]} s in the two measured updates" in text
    last, last_base = q8["update_times"][-1], base["update_times"][-1]
    assert f"{last:.1f} s against {last_base:.1f}, is still {last_base / last:.2f}x" in text
    err = (q8["plan"]["phase_peak_bytes"]["scoring"] / GIB) / q8["phase_peak_gib"]["scoring"][-1] - 1
    assert f"scoring peak planned {-100 * err:.1f}% under what it measured" in text
    summary = json.loads((CALL / "frozen8" / "results.json").read_text())["summary"]
    worst = {r["row"]: max(abs(x["error"]) for x in summary if x["row"] == r["row"]) for r in rows.values()}
    assert (
        worst["full7b_offload"] <= 0.013 and f"{100 * abs(err):.1f}" == f"{100 * worst['full7b_frozen8']:.1f}"
    )
    assert all(r["oom_splits"] == 0 for r in rows.values())


def test_the_docs_quote_the_rows():
    rows = _rows()
    base, q8 = rows["full7b_offload"], rows["full7b_frozen8"]
    said = f"{q8['tokens_per_s']:,.0f} tokens/s against {base['tokens_per_s']:,.0f} as given"
    ratio = f"{q8['tokens_per_s'] / base['tokens_per_s']:.2f}x"
    quotes = {
        "ppo.md": f"{said} ({ratio}; scoring {q8['score_s']:.1f} against {base['score_s']:.1f} s)",
        "results.md": f"ran {said} ({ratio})",
    }
    for name, quote in quotes.items():
        assert quote in _flat((ROOT / "docs" / name).read_text()), name


def test_the_families_gpu_log_is_what_the_text_says():
    log = (CALL / "families_gpu" / "families_gpu.log").read_text()
    summary = log.strip().splitlines()[-1]
    passed, failed = (int(re.search(rf"(\d+) {w}", summary).group(1)) for w in ("passed", "failed"))
    text = _flat(_section("benchmarks/card80/README.md", TITLE))
    assert f"{passed} passed, {failed} failed" in text
    failures = [ln for ln in log.splitlines() if ln.startswith("FAILED")]
    assert len(failures) == failed and all("granitemoe" in ln for ln in failures)
    assert "H100" in (CALL / "families_gpu" / "gpu.txt").read_text()
