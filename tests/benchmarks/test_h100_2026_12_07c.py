"""The numbers written from the third 2026-12-07 H100 session are the stored files': the compiled 7B decode
step over bf16 and int8 caches, the compiled Pythia and MoE rows (benchmarks/rollout/results/h100/
call_2026-12-07c, benchmarks/rollout/README.md), and the 7B LoRA PPO rows with each cache
(benchmarks/card80/results/h100_2026-12-07c, benchmarks/card80/README.md, docs/configuration.md,
rollout_kv_cache_dtype's help and memory/kv_choice.py's docstring). A re-run that changes a stored file, or an
edit that leaves text and file apart, fails here."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks.readme_text import section as _section
from tests.benchmarks.readme_text import table as _table

ROOT = Path(__file__).resolve().parents[2]
CALL = ROOT / "benchmarks" / "rollout" / "results" / "h100" / "call_2026-12-07c"
CARD80 = ROOT / "benchmarks" / "card80" / "results" / "h100_2026-12-07c" / "lora7b_kv"


def test_the_kv_fix_table_is_the_stored_call():
    data = json.loads((CALL / "kv_fix" / "results.json").read_text())
    assert "H100" in data["env"]["gpu"] and data["decode_mode"] == "compile"
    ran = {(r["cache"], r["batch"]): r for r in data["results"]}
    assert ran["bf16", 256]["status"] == "OOM"
    rows = _table(_section("benchmarks/rollout/README.md", "third session: the fix confirmed"), "cache")
    assert len(rows) == 3
    for cache, batch, step, row, gib in rows:
        r = ran[cache, int(batch)]
        assert r["status"] == "ok" and r["decode_mode_ran"] == "compile"
        assert (step, row, gib) == (
            f"{r['ms_per_step']:.2f}",
            f"{r['ms_per_token']:.4f}",
            f"{r['cache_mib'] / 1024:.1f}",
        )
    # what the text and kv_choice's docstring conclude from them
    assert ran["int8", 128]["ms_per_step"] < ran["bf16", 128]["ms_per_step"]
    gain = ran["bf16", 128]["ms_per_token"] / ran["int8", 256]["ms_per_token"]
    assert f"{gain:.2f}" == "1.35"
    doc = (ROOT / "src" / "rapidfire_hf" / "memory" / "kv_choice.py").read_text()
    for r in (ran["bf16", 128], ran["int8", 128], ran["int8", 256]):
        assert f"{r['ms_per_step']:.2f} ms" in doc or f"{r['ms_per_step']:.2f}" in doc


def test_the_compiled_family_rows_are_the_stored_call():
    data = json.loads((CALL / "fam" / "results.json").read_text())
    ms = {(r["family"], r["batch"]): r for r in data["results"] if r["system"] == "ours_compile"}
    per_byte = {(s["family"], s["batch"]): s["per_byte_vs_llama"] for s in data["summary"] if "ours_ms" in s}
    rows = _table(_section("benchmarks/rollout/README.md", "Compiled Pythia and MoE rows"), "family")
    assert len(rows) == 5
    for family, batch, step, byte in rows:
        r = ms[family, int(batch)]
        assert r["decode_mode_ran"] == "compile" and step == f"{r['ms_per_step']:.2f}"
        assert byte == f"{per_byte[family, int(batch)]:.2f}"
    gather = next(s for s in data["summary"] if s.get("moe_form") == "gather")
    assert (f"{gather['auto_ms']:.2f}", f"{gather['ms']:.2f}", f"{gather['over_auto']:.2f}") == (
        "3.87",
        "8.64",
        "2.23",
    )
    assert gather["auto_decode_mode_ran"] == "compile"
    log = (CALL / "moe_tests.log").read_text()
    assert "2 failed, 2 passed" in log and "test_the_default_form_is_grouped_on_cuda_and_compiles" in log


def test_the_lora_rows_are_the_stored_call_and_every_text_quoting_them():
    data = json.loads((CARD80 / "results.json").read_text())
    assert "H100" in data["environment"]["gpu"]
    ran = {r["row"]: r for r in data["rows"]}
    bf16, int8 = ran["lora7b_offload"], ran["lora7b_int8kv"]
    assert (bf16["plan"]["generation_rows"], int8["plan"]["generation_rows"]) == (128, 256)
    assert bf16["oom_splits"] == int8["oom_splits"] == 0 and bf16["updates"] == int8["updates"] == 3
    assert "rollout_kv_cache_dtype" not in bf16 and int8["rollout_kv_cache_dtype"] == "int8"

    def med(xs):  # the median of the updates after the warm-up (two: their mean)
        rest = sorted(xs[1:])
        return (rest[0] + rest[-1]) / 2

    rows = _table(_section("benchmarks/card80/README.md", "third session"), "row")
    for cells, r in zip(rows, (bf16, int8)):
        assert cells[1:6] == [
            f"{med(r['update_times']):.1f}", f"{med(r['gen_times']):.1f}", f"{med(r['score_times']):.1f}",
            f"{med(r['train_times']):.1f}", f"{r['tokens_per_s']:,.0f}",
        ]  # fmt: skip
    said = (f"{bf16['tokens_per_s']:,.0f}", f"{int8['tokens_per_s']:,.0f}")
    assert said == ("3,719", "4,084")
    for path in ("docs/configuration.md", "src/rapidfire_hf/ppo/config.py", "src/rapidfire_hf/memory/kv_choice.py",
                 "benchmarks/rollout/README.md"):  # fmt: skip
        text = (ROOT / path).read_text()
        assert all(n in text for n in said), path
