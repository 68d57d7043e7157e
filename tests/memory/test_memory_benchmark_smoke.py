"""benchmarks/memory/run.py --smoke: runs on CPU end to end; the callback's time cost is measured fairly
(warm-up pass, interleaved rounds, paired per-round differences) and reported with its spread."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.bench_loader import load_benchmark

VARIANTS = ("no_callback", "callback_t1.0", "callback_t0.3", "callback_t0.15")


def load(name: str):
    return load_benchmark(f"memory/{name}.py")


def test_round_orders_are_a_balanced_latin_square():
    workloads = load("workloads")
    orders = workloads.round_orders(list(VARIANTS), 4)
    assert all(sorted(o) == sorted(VARIANTS) for o in orders)
    for position in range(4):  # each variant once in each position
        assert sorted(o[position] for o in orders) == sorted(VARIANTS)
    pairs = [(o[i], o[i + 1]) for o in orders for i in range(3)]
    assert len(set(pairs)) == len(pairs) == 12  # each variant directly after each other one once
    assert workloads.round_orders(list(VARIANTS), 6)[4:] == orders[:2]  # cycles
    for n in (3, 5):  # odd counts: mirrored rows balance positions over 2n rounds
        names = [str(i) for i in range(n)]
        rows = workloads.round_orders(names, 2 * n)
        for position in range(n):
            assert sorted(r[position] for r in rows) == sorted(names * 2)


def test_time_cost_is_the_paired_per_round_difference():
    workloads = load("workloads")
    variants = {
        "no_callback": {"rounds": [{"total_s": 10.0}, {"total_s": 12.0}, {"total_s": 11.0}]},
        "callback_t0.3": {"rounds": [{"total_s": 10.5}, {"total_s": 12.1}, {"total_s": 12.0}]},
    }
    cost = workloads.time_cost(variants)["callback_t0.3"]
    assert cost["diff_s_per_round"] == pytest.approx([0.5, 0.1, 1.0])
    assert cost["diff_s"] == pytest.approx({"median": 0.5, "min": 0.1, "max": 1.0})
    assert cost["rel"]["median"] == pytest.approx(0.05)
    assert "no_callback" not in workloads.time_cost(variants)


def test_smoke_run_writes_results_with_fair_timing(tmp_path, capsys):
    run = load("run")
    assert run.main(["--out", str(tmp_path), "--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "time cost of the callback" in printed and "noise" in printed

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "memory.png").stat().st_size > 0
    assert results["meta"]["setting"]["rounds"] == 2
    summary = results["summary"]
    assert "noise" in summary["note"]
    for group in ("allocator/native", "allocator/expandable"):
        raw = results[group]
        assert raw["rounds"] == 2 and len(raw["orders"]) == 2
        assert raw["orders"][0] != raw["orders"][1]  # the order changes between rounds
        assert len(raw["warmup"]) == 1 and raw["warmup"][0]["total_s"] > 0  # untimed warm-up pass first
        steps = results["meta"]["setting"]["steps"]
        for name in VARIANTS:
            v = raw[name]
            assert len(v["steps"]) == steps
            assert [w["round"] for w in v["rounds"]] == [0, 1]
            assert [w["position"] for w in v["rounds"]] == [o.index(name) for o in raw["orders"]]
            # every step of a window is timed; the reported time is the median over rounds
            assert v["total_s_median"] == pytest.approx(statistics.median(w["total_s"] for w in v["rounds"]))
            s = summary[group][name]
            assert s["step_s_median"] > 0 and s["round_total_s_median"] > 0
            assert len(s["max_reserved_gib_rounds"]) == len(s["compactions_rounds"]) == 2
            assert {"max_reserved_gib", "mean_fragmentation", "compactions", "alloc_retries"} <= set(s)
            assert "time_vs_no_callback" not in s  # the old single ratio is gone
            if name == "no_callback":
                assert "time_cost" not in s
                continue
            cost = s["time_cost"]
            base = [w["total_s"] for w in raw["no_callback"]["rounds"]]
            diffs = [w["total_s"] - b for w, b in zip(v["rounds"], base)]
            assert cost["diff_s_per_round"] == pytest.approx(diffs)
            assert cost["diff_s"]["median"] == pytest.approx(statistics.median(diffs))
            assert cost["diff_s"]["min"] <= cost["diff_s"]["median"] <= cost["diff_s"]["max"]
            assert cost["rel"]["min"] <= cost["rel"]["median"] <= cost["rel"]["max"]
        assert summary[group]["callback_t1.0"]["compactions"] == 0  # threshold 1.0 never compacts
    assert set(summary["checkpointing"]) == {"conservative", "balanced", "aggressive"}
