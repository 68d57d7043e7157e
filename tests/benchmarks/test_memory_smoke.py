"""benchmarks/memory/run.py --smoke: runs on CPU end to end; the callback's time cost is measured fairly
(warm-up pass, interleaved rounds, paired per-round differences) and reported with its spread, for the
callback as PPOTrainer / enable_rapidfire install it too; the largest micro-batch is searched from an empty
cache and after the fragmenting schedule without and with the callback."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.benchmarks.loader import load_benchmark

VARIANTS = ("no_callback", "callback_t1.0", "callback_t0.3", "callback_default")


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


def test_search_largest_matches_a_linear_scan_and_probes_each_batch_once():
    workloads = load("workloads")
    for cap in (1, 2, 7, 64):
        for limit in range(cap + 2):  # fits(b) iff b <= limit; limit 0: nothing fits, > cap: all fit
            reference = max((b for b in range(1, cap + 1) if b <= limit), default=0)
            for start in (1, 2, limit, limit + 1, cap, cap + 5):
                probed = []
                fits = lambda b, probed=probed, limit=limit: probed.append(b) or b <= limit  # noqa: E731
                found = workloads.search_largest(fits, start, cap)
                assert found == reference, (cap, limit, start)
                assert len(probed) == len(set(probed)) and all(1 <= b <= cap for b in probed)
    probed = []  # from 1 it probes the powers of two first, as the earlier power-of-two search did
    assert workloads.search_largest(lambda b: probed.append(b) or b <= 19, 1, 64) == 19
    assert probed[:6] == [1, 2, 4, 8, 16, 32] and len(probed) == 10
    with pytest.raises(ValueError, match="cap"):
        workloads.search_largest(lambda b: True, 1, 0)


def test_default_variant_is_what_ppo_trainer_and_enable_rapidfire_install(tmp_path):
    from rapidfire_hf.config import load_config
    from rapidfire_hf.memory import MemoryCompactionCallback

    workloads = load("workloads")
    cfg = {**workloads.setting(True), "out_dir": str(tmp_path)}
    settings = ("compaction_threshold", "optimization", "min_interval_steps", "min_release_bytes")
    settings += ("sample_every", "pressure_fraction")
    bench = workloads.make_callback(cfg, "callback_default")
    for installed in (
        MemoryCompactionCallback(None, telemetry=False),  # PPOTrainer without a rapidfire config
        MemoryCompactionCallback(load_config().memory, telemetry=False),  # enable_rapidfire's default config
    ):
        assert [getattr(bench, k) for k in settings] == [getattr(installed, k) for k in settings]
    assert (bench.optimization, bench.compaction_threshold, bench.pressure_fraction) == (
        "balanced",
        0.3,
        None,
    )
    bench.telemetry.close()
    t03 = workloads.make_callback(cfg, "callback_t0.3")  # compacts on its threshold whatever is reserved
    assert (t03.optimization, t03.pressure_fraction, t03.min_interval_steps) == ("aggressive", 0.0, 5)
    t03.telemetry.close()
    with pytest.raises(ValueError, match="no_callback"):
        workloads.check_variants(["callback_default"], [])
    with pytest.raises(ValueError, match="unknown variant"):
        workloads.check_variants(["no_callback", "callback_t9"], [])


def test_workloads_cli_passes_variant_lists(tmp_path):
    workloads = load("workloads")
    out = tmp_path / "native.json"
    args = ["allocator", str(out), "--smoke", "--rounds", "1", "--variants", "no_callback,callback_t0.15"]
    workloads.main(args + ["--batch-variants", "none"])
    result = json.loads(out.read_text())
    assert result["variants"] == ["no_callback", "callback_t0.15"] and result["batch_variants"] == []
    assert result["orders"] == [["no_callback", "callback_t0.15"]] and result["orders_balanced"] is False
    assert set(result["time_cost"]) == {"callback_t0.15"} and result["micro_batch"]["after_schedule"] == {}
    assert result["callback_settings"]["callback_t0.15"]["compaction_threshold"] == 0.15


@pytest.mark.slow  # 6 s on a 2-core CPU
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
        assert raw["orders_balanced"] is False  # 2 rounds of 4 variants: half a Williams square
        settings = summary[group]["callback_settings"]
        assert set(settings) == set(VARIANTS[1:])
        assert settings["callback_default"]["optimization"] == "balanced"
        assert settings["callback_default"]["min_interval_steps"] == 20
        # the largest micro-batch: from an empty cache, and after the schedule without / with the callback
        mb = raw["micro_batch"]
        cap = results["meta"]["setting"]["search_cap"]
        assert mb["clean"] == cap and mb["clean_pow2"] == raw["largest_micro_batch"] == cap  # no OOM on a CPU
        assert set(mb["after_schedule"]) == {"no_callback", "callback_default"}
        for v in mb["after_schedule"].values():
            assert v["largest"] == cap
            assert [p["batch"] for p in v["probes"]] == [cap]  # started at the clean result: one probe
            assert v["probes"][0]["fits"] and v["probes"][0]["schedule_compactions"] == 0
        assert summary[group]["micro_batch"]["after_schedule"] == {
            "no_callback": cap,
            "callback_default": cap,
        }
    assert "largest micro-batch" in printed and "callback_default" in printed
    assert set(results["meta"]["wall_s"]) == set(results["meta"]["groups"]) == set(run.GROUPS)
    assert set(summary["checkpointing"]) == {"conservative", "balanced", "aggressive"}
