"""README.md's one-H100 numbers are the stored results': row 15 (PPO with Gemma-3 / OLMo-2 policies) from
benchmarks/ppo_vs_trl/results/h100/families_b8, row 16 (the generic decode path) from
benchmarks/rollout/results/h100/generic, and the 80 GB 7B numbers (README's 7B paragraph; docs/results.md's
paragraph and per-phase table, "7B") from benchmarks/card80/results/h100_2026-12-06/full7b_trades (its
``full7b_offload`` row, PPOConfig's default ``host_offload="auto"``, and the ``full7b_off`` row of the same
call). A re-run that
changes a stored file, or a README or docs edit, that leaves the two apart fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "docs" / "results.md").read_text()  # the 80 GB paragraph's home
GIB = 2**30


def _row(number: int) -> list[str]:
    line = next(x for x in README.splitlines() if x.startswith(f"| {number} | "))
    return [c.strip() for c in line.strip("|").split("|")]


def _numbers(cell: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?:\.\d+)?", cell)]


def _load(path: str) -> dict:
    return json.loads((ROOT / "benchmarks" / path).read_text())


def test_row_15_is_families_b8_each_pair_from_one_call():
    _, what, stock, ours, ratio = _row(15)
    assert "H100" in what and "Gemma-3-1B / OLMo-2-1B" in what
    shown_stock, shown_ours = _numbers(stock), _numbers(ours)
    shown_ratio = [float(x) for x in re.findall(r"([\d.]+)×", ratio)]
    for i, family in enumerate(("gemma3-1b", "olmo2-1b")):
        data = _load(f"ppo_vs_trl/results/h100/families_b8/{family}/results.json")
        assert "H100" in data["environment"]["gpu"]
        rows = {r["name"]: r for r in data["rows"]}
        s, o = rows["tp_trl_b8"], rows["tp_rapidfire_b8"]
        assert s["status"] == o["status"] == "ok" and s["shape"] == o["shape"] == family
        assert o["rollout_backend"] == "static"  # the family ran on the engine, not model.generate
        assert shown_stock[i] == round(s["tokens_per_s"]) and shown_ours[i] == round(o["tokens_per_s"])
        assert shown_ratio[i] == round(o["tokens_per_s"] / s["tokens_per_s"], 1)


def test_row_16_is_the_generic_call():
    _, what, hf, ours, ratio = _row(16)
    data = _load("rollout/results/h100/generic/results.json")
    rows = (
        {(r["system"], r["batch"]): r for r in data["results"]}
        if "results" in data
        else {(r["system"], r["batch"]): r for r in data["rows"]}
    )
    dyn, gen = rows["hf_dynamic", 8], rows["generic_cuda_graph", 8]
    assert _numbers(hf) == [round(dyn["ms_per_step"], 1)] and _numbers(ours) == [round(gen["ms_per_step"], 2)]
    assert f"{dyn['ms_per_step'] / gen['ms_per_step']:.1f}×" in ratio


TRADES = "card80/results/h100_2026-12-06/full7b_trades/results.json"


def _full7b_plan(name: str = "full7b_offload") -> dict:
    data = _load(TRADES)
    assert "H100 80GB" in data["environment"]["gpu"]
    (row,) = [r for r in data["rows"] if r["row"] == name]
    return row


def test_readme_7b_paragraph_is_full7b_plan():
    start = README.index("**7B PPO** (")
    text = " ".join(README[start : README.index("\n\n", start)].split())
    row = _full7b_plan()
    assert row["status"] == "ok" and row["rapidfire_config"] == "aggressive"
    assert "on one H100 80 GB, where stock TRL cannot run 7B PPO, `aggressive` trains at" in text
    assert (
        f"**{round(row['tokens_per_s']):,} tokens/s** with **{row['oom_splits']} out-of-memory splits**"
        in text
    )


def test_80gb_paragraph_is_full7b_plan():
    start = RESULTS.index("**7B full fine-tuning on one H100 80 GB**")
    text = RESULTS[start : RESULTS.index("### Commands", start)]
    row = _full7b_plan()
    assert row["status"] == "ok" and row["batch"] == 160 and row["rapidfire_config"] == "aggressive"
    assert f"**{round(row['tokens_per_s']):,} tokens/s**" in text
    assert f"peak {row['peak_gib']:.1f} GiB" in text
    assert row["host_offload"] == "auto" and 'with `host_offload="auto"` (the default)' in " ".join(text.split())
    off = _full7b_plan("full7b_off")
    assert off["status"] == "ok" and off["host_offload"] == "off" and off["oom_splits"] == 0
    assert f'In the same call `host_offload="off"` ran {round(off["tokens_per_s"]):,} tokens/s, also with 0 splits' in " ".join(text.split())
    assert (
        f"**{row['oom_splits']}\nout-of-memory splits**" in text
        or f"**{row['oom_splits']} out-of-memory" in text
    )
    planned, measured = row["plan"]["phase_peak_bytes"], row["phase_peak_gib"]
    for name, key in (("generation", "rollout"), ("scoring", "scoring"), ("training", "training")):
        line = next(x for x in text.splitlines() if x.startswith(f"| {name}"))
        p, m = _numbers(line.split("|")[2]), _numbers(line.split("|")[3])
        assert p == [round(planned[name] / GIB, 2)], name
        # the steady updates' peak (the first update compiles)
        assert m == [round(max(measured[key][1:]), 2)], name
        assert abs(p[0] - m[0]) / m[0] < 0.10  # issue 46: the plan within 10% of what ran
