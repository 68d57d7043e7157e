"""The numbers written from the 2026-12-07 H100 calls are the stored files': PPO batch 8 main vs e0ac75f
(benchmarks/ppo_vs_trl/results/h100/b8_vs_e0ac75f_2026-12-07), 7B LoRA with the int8 KV cache
(benchmarks/card80/results/h100_2026-12-07, its README paragraph and docs/configuration.md's row), the
per-family decode table, the sliding-window ring and the GPU checks (benchmarks/rollout/results/h100/*_2026-12-07,
benchmarks/rollout/README.md). A re-run that changes a stored file, or an edit that leaves text and file
apart, fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _text(path: str) -> str:
    return (ROOT / path).read_text()


def _json(path: str) -> dict:
    return json.loads((BENCH / path).read_text())


def _nums(text: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]


def _median_after_warmup(times: list[float]) -> float:
    rest = sorted(times[1:])
    mid = len(rest) // 2
    return rest[mid] if len(rest) % 2 else (rest[mid - 1] + rest[mid]) / 2


def test_b8_table_is_the_printed_summary():
    folder = "benchmarks/ppo_vs_trl/results/h100/b8_vs_e0ac75f_2026-12-07"
    printed = {}
    for line in _text(f"{folder}/summary.txt").splitlines():
        if " ok " not in line:
            continue
        name = line.split()[0]
        lists = {k: [float(v) for v in re.search(k + r" \[([^\]]*)\]", line).group(1).split(",")]
                 for k in ("updates", "score", "gen")}  # fmt: skip
        printed[name] = (float(line.split("tok/s ")[1].split()[0]), lists)
    rows = {r.split("|")[2].strip().split()[0]: r for r in _text(f"{folder}/README.md").splitlines()
            if r.startswith("| rapidfire |")}  # fmt: skip
    for name, commit in (("main1", "e1ec15b"), ("prev1", "e0ac75f")):
        tok_s, lists = printed[name]
        cells = [c.strip() for c in rows[commit].strip("|").split("|")]
        s_upd, updates = _nums(cells[2])[0], _nums(cells[2])[1:]
        assert s_upd == round(_median_after_warmup(lists["updates"]), 3)
        assert updates == [round(t, 3) for t in lists["updates"][1:]]
        assert _nums(cells[3]) == [round(tok_s)]
        assert _nums(cells[4]) == [round(_median_after_warmup(lists["gen"]), 3)]
        assert _nums(cells[5]) == [round(_median_after_warmup(lists["score"]), 3)]
    # the worker's own final line agrees with the printed summary
    for name in ("main1", "prev1"):
        worker = json.loads(_text(f"{folder}/{name}.log").strip().splitlines()[-1])
        assert round(worker["tokens_per_s"]) == round(printed[name][0])


def test_int8_kv_paragraph_and_config_row_are_the_stored_rows():
    new = _json("card80/results/h100_2026-12-07/lora7b_int8kv/results.json")["rows"][0]
    old = _json("card80/results/h100_2026-12-06/lora7b_offload/results.json")["rows"][0]
    assert new["rollout_kv_cache_dtype"] == "int8" and new["plan"]["generation_rows"] == 256
    assert old["plan"]["generation_rows"] == 128 and new["oom_splits"] == 0
    gen_new, gen_old = _median_after_warmup(new["gen_times"]), _median_after_warmup(old["gen_times"])
    para = _text("benchmarks/card80/README.md").split("the int8 KV cache does not pay here")[1]
    for shown in (f"{gen_new:.1f} s", f"{gen_old:.1f} s", f"{new['s_per_update']:.1f} s/update",
                  f"{round(new['tokens_per_s']):,} tokens/s"):  # fmt: skip
        assert shown in para, shown
    row = next(
        x for x in _text("docs/configuration.md").splitlines() if x.startswith("| `rollout_kv_cache_dtype`")
    )
    # the row now leads with the call after the fix (test_h100_2026_12_07c) and names this one's rate
    assert f"a PPO row at {round(new['tokens_per_s']):,} tokens/s (`h100_2026-12-07`)" in row


def _ms(data: dict) -> dict:
    return {
        (r["family"], r["system"], r["batch"]): r["ms_per_step"]
        for r in data["results"]
        if r["status"] == "ok"
    }


def test_family_table_is_the_stored_call():
    data = _json("rollout/results/h100/families_2026-12-07/results.json")
    assert "H100" in data["gpu"]
    ms, weight = _ms(data), data["weight_gib"]
    readme = _text("benchmarks/rollout/README.md").split("(`results/h100/families_2026-12-07`)")[1]
    lines = {x.split("|")[1].strip(): x for x in readme.split("\n\n")[2].splitlines()[2:]}
    assert set(lines) == set(weight)
    for family, line in lines.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        for col, (system, batch, digits) in enumerate(
            [("ours_cuda_graph", 8, 2), ("ours_compile", 8, 2), ("hf_dynamic", 8, 1), ("hf_static", 8, 2)], 2
        ):
            value = ms.get((family, system, batch))
            assert cells[col] == ("-" if value is None else f"{value:.{digits}f}"), (family, system)
        assert cells[7] == f"{ms[family, 'ours_cuda_graph', 64]:.2f}"
        per_byte = (
            ms[family, "ours_cuda_graph", 64]
            / weight[family]
            / (ms["llama-1.1b", "ours_cuda_graph", 64] / weight["llama-1.1b"])
        )
        assert cells[10].split(" / ")[2] == f"{per_byte:.2f}"
    # the summary the script wrote says the same per-byte ratio at batch 64
    summary = {(s["family"], s["batch"]): s for s in data["summary"]}
    assert round(summary["gemma3-1b", 64]["per_byte_vs_llama"], 2) == float(
        lines["gemma3-1b"].split(" / ")[-1][:4]
    )


def test_ring_and_diag_lines_are_the_stored_files():
    ring = {(s["batch"]): s for s in _json("rollout/results/h100/ring_2026-12-07/results.json")["summary"]
            if "sliding" in s}  # fmt: skip
    readme = _text("benchmarks/rollout/README.md")
    for batch, text in ((8, "batch 8 {r:.2f} ms with the ring against {f:.2f} ms"),
                        (64, "batch 64 {r:.2f} against {f:.2f} ms")):  # fmt: skip
        s = ring[batch]
        assert text.format(r=s["ring_ms"], f=s["full_ms"]) in readme
        assert f"({s['full_over_ring']:.2f}x)" in readme
        assert f"{s['ring_peak_gib']:.2f} vs {s['full_peak_gib']:.2f} GiB" in readme
    variants = _text("benchmarks/rollout/results/h100/diag_2026-12-07/variants.log")
    assert "gemma2 fp32 tf32=off reference attention=eager: equal" in variants
    assert "mixtral fp32 tf32=off reference attention=sdpa: equal" in variants
    tests = _text("benchmarks/rollout/results/h100/diag_2026-12-07/tests.log")
    assert re.search(r"\b12 passed\b", tests) and "failed" not in tests
