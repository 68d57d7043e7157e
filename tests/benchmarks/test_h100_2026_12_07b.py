"""The numbers written from the second 2026-12-07 H100 session are the stored files': the compiled batch-64
family rows, the MoE expert forms (and the docstring of the default they chose), the 8-bit KV cache's decode
steps (benchmarks/rollout/results/h100/{fam64,moeform,kv_cache}_2026-12-07, benchmarks/rollout/README.md,
rollout/moe_decode.py). A re-run that changes a stored file, or an edit that leaves text and file apart,
fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "rollout" / "results" / "h100"


def _json(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _section(title: str) -> str:
    """The README text from the heading holding ``title`` to the next heading of any level."""
    readme = (ROOT / "benchmarks" / "rollout" / "README.md").read_text()
    start = readme.index(title)
    nxt = re.search(r"\n#{2,3} ", readme[start:])
    return readme[start : start + nxt.start()] if nxt else readme[start:]


def _rows(text: str, first_cell: str) -> dict[str, list[str]]:
    """Markdown table rows whose first cell is in the table under ``first_cell`` (its header cell)."""
    lines = text.split(f"| {first_cell} |")[1].split("\n\n")[0].splitlines()[2:]
    return {
        ln.split("|")[1].strip(): [c.strip().strip("*") for c in ln.strip("|").split("|")] for ln in lines
    }


def test_batch64_compiled_table_is_the_stored_call():
    data = _json("fam64_2026-12-07/results.json")
    assert "H100" in data["gpu"]
    ms = {(r["family"], r["system"]): r["ms_per_step"] for r in data["results"] if r["status"] == "ok"}
    per_byte = {s["family"]: s["per_byte_vs_llama"] for s in data["summary"]}
    rows = _rows(_section("Batch 64 compiled and the MoE expert forms"), "family")
    assert set(rows) == {"llama-1.1b", "gemma3-1b", "olmo2-1b", "phi3-mini"}
    for family, cells in rows.items():
        assert cells[1] == f"{ms[family, 'ours_compile']:.2f}"
        static = ms.get((family, "hf_static"))
        assert cells[2] == ("-" if static is None else f"{static:.2f}")
        assert cells[3] == f"{per_byte[family]:.2f}"
        assert per_byte[family] <= 1.25  # what the text says of every dense family timed


def test_moe_form_table_and_default_docstring_are_the_stored_call():
    data = _json("moeform_2026-12-07/results.json")
    ms = {(r["system"], r["batch"]): r["ms_per_step"] for r in data["results"] if r["status"] == "ok"}
    assert {r["decode_mode_ran"] for r in data["results"]} == {"cuda_graph"}
    rows = _rows(_section("Batch 64 compiled and the MoE expert forms"), "batch")
    cols = ["ours_cuda_graph", "ours_cuda_graph@gather", "ours_cuda_graph@dense", "ours_cuda_graph@grouped"]
    for batch in (8, 64):
        cells = rows[str(batch)]
        assert cells[1:] == [f"{ms[c, batch]:.2f}" for c in cols]
        fastest = min(cols[1:], key=lambda c: ms[c, batch]).split("@")[1]
        # the default rule picks the fastest form at each measured batch (8 x 8 pairs <= 128 experts < 64 x 8)
        from rapidfire_hf.rollout.moe_decode import default_form

        assert default_form(batch, 8, 128, grouped_ok=True) == fastest
    doc = " ".join(
        (ROOT / "src/rapidfire_hf/rollout/moe_decode.py")
        .read_text()
        .split("def default_form")[1]
        .split('"""')[1]
        .split()
    )
    for batch in (8, 64):
        said = doc.split(f"batch {batch} ")[1][:60]
        for form in ("gather", "dense", "grouped"):
            assert f"{form} {ms[f'ours_cuda_graph@{form}', batch]:.2f}" in said, (form, batch, said)
    log = (RESULTS / "moeform_2026-12-07" / "tests.log").read_text()
    assert re.search(r"\b2 passed\b", log) and "failed" not in log


def test_kv_cache_table_is_the_stored_calls():
    rows = _rows(_section("One H100 80 GB, 2026-12-07 (`results/h100/kv_cache_2026-12-07`)"), "decode step")
    for label, folder in (("compiled", "compile"), ("recorded, Triton", "cuda_graph_triton"),
                          ("recorded, SDPA", "cuda_graph_sdpa")):  # fmt: skip
        data = _json(f"kv_cache_2026-12-07/{folder}/results.json")
        assert "H100" in data["env"]["gpu"]
        ms = {r["cache"]: r for r in data["results"] if r["batch"] == 128 and r["status"] == "ok"}
        assert {r["decode_mode_ran"] for r in ms.values()} == {data["decode_mode"]}
        (cells,) = [c for key, c in rows.items() if key.startswith(label)]
        assert cells[1:] == [f"{ms['bf16']['ms_per_step']:.2f}", f"{ms['int8']['ms_per_step']:.2f}"]
    compiled = _json("kv_cache_2026-12-07/compile/results.json")["results"]
    graph = _json("kv_cache_2026-12-07/cuda_graph_triton/results.json")["results"]
    extra = {n: r[1]["ms_per_step"] - r[0]["ms_per_step"] for n, r in (("c", compiled), ("g", graph))}
    text = _section("One H100 80 GB, 2026-12-07 (`results/h100/kv_cache_2026-12-07`)")
    assert (
        f"cost {extra['c']:.1f} ms more than over bf16, where the recorded one cost {extra['g']:.1f} ms"
        in text
    )
