"""benchmarks/card80: its table puts the plan's per-phase prediction beside the measured peak (checked on a
stored H200 row), and --smoke runs a row on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.card80.run import main, markdown, parse_args, shape_prediction, summary, worker_config

STORED = Path(__file__).resolve().parents[2] / "benchmarks/presets/results/h200/full7b/results.json"


def test_rows_are_the_issues_runs_and_unknown_rows_are_refused(capsys):
    args = parse_args(["--out", "x"])
    full, lora = worker_config("full7b", args), worker_config("lora7b", args)
    assert (full["shape"], full["batch"], full["peft"], full["reward"]) == ("llama-7b", 160, False, "model")
    assert (lora["batch"], lora["peft"], lora["value_mode"]) == (256, True, "fused")
    assert full["rapidfire_config"] == "aggressive" and full["score_chunk"] == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--rows", "full7b,huge"])
    assert "unknown row(s) huge" in capsys.readouterr().err


def test_the_table_of_a_stored_gpu_row():
    row = next(r for r in json.loads(STORED.read_text())["rows"] if r["row"] == "aggressive")
    row = {**row, "row": "full7b", "shape_plan": shape_prediction(row)}
    lines = summary(row)
    assert [x["phase"] for x in lines] == ["generation", "scoring", "training"]
    for x in lines:
        measured = row["phase_peak_gib"][{"generation": "rollout"}.get(x["phase"], x["phase"])][-1]
        assert x["measured_gib"] == measured
        assert x["planned_gib"] == row["plan"]["phase_peak_bytes"][x["phase"]] / 2**30
        assert x["error"] == pytest.approx((x["planned_gib"] - measured) / measured)
        # the shape's plan for that card (its own choices) is not the run's, but the run's own choices
        # replayed are within 10% (tests/memory/test_planner_calibration.py); here it exists and is sane
        assert 0 < x["shape_planned_gib"] < row["gpu_total_gib"]
    table = markdown(lines)
    assert table.count("\n") == 5 and "| full7b | training |" in table and "+4.7%" in table


@pytest.mark.slow  # one tiny PPO run in a worker process (~45 s)
def test_smoke_runs_a_row_on_the_cpu(tmp_path):
    lines = main(["--out", str(tmp_path), "--smoke", "--rows", "full7b", "--updates", "2"])
    assert [x["status"] for x in lines] == ["ok"] * 3 and lines[0]["oom_splits"] == 0
    assert (tmp_path / "table.md").read_text().startswith("| row | phase |")
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["rows"][0]["plan"]["phase_peak_bytes"] and stored["summary"] == lines
    # the row says how its decode steps ran (the worker's run_state; the CPU smoke: model.generate)
    row = stored["rows"][0]
    assert row["decode_mode_ran"] == {"hf": "generate", "static": "eager"}[row["rollout_backend"]]
    assert row["decode_fallbacks"] == []


def test_the_trades_rows_differ_only_in_host_offload_and_reach_the_trainer():
    """``h100.sh OUT full7b_trades``: the plan without host offload and the plan with it, same run otherwise."""
    from benchmarks.ppo_vs_trl.worker import speedup_args

    args = parse_args(["--out", "x", "--rows", "full7b_off,full7b_offload", "--updates", "3"])
    off, on = worker_config("full7b_off", args), worker_config("full7b_offload", args)
    assert speedup_args(off)["host_offload"] == "off" and speedup_args(on)["host_offload"] == "auto"
    strip = {"name", "row", "host_offload"}
    assert {k: v for k, v in off.items() if k not in strip} == {k: v for k, v in on.items() if k not in strip}
    assert "host_offload" not in worker_config("full7b", args)  # the stored row's run: the default
    card = {"gpu_total_gib": 79.19, "shape": "llama-7b", "batch": 160, "micro": 8, "prompt_len": 128,
            "response_len": 384, "value_mode": "fused", "peft": False, "reward": "model"}  # fmt: skip
    assert shape_prediction({**card, "host_offload": "off"})["choices"]["offload_frozen"] is False
    chosen = shape_prediction({**card, "host_offload": "auto"})["choices"]
    assert chosen["offload_frozen"] is True and chosen["splits"] == 0
    script = (Path(__file__).resolve().parents[2] / "benchmarks/card80/h100.sh").read_text()
    assert "full7b_trades) $PY benchmarks/card80/run.py" in script and "full7b_off,full7b_offload" in script


@pytest.mark.parametrize("base", ["lora7b", "full7b"])
def test_the_kv_rows_differ_only_in_the_kv_cache_and_reach_the_trainer(base):
    """``h100.sh OUT lora7b_kv`` / ``full7b_kv``: the model-dtype cache and the int8 cache, same run otherwise."""
    from benchmarks.ppo_vs_trl.worker import speedup_args

    args = parse_args(
        ["--out", "x", "--rows", f"{base}_modelkv,{base}_int8kv,{base}_offload", "--updates", "3"]
    )
    plain, small = worker_config(f"{base}_modelkv", args), worker_config(f"{base}_int8kv", args)
    assert speedup_args(small)["rollout_kv_cache_dtype"] == "int8"
    assert speedup_args(plain)["rollout_kv_cache_dtype"] == "model"
    assert "rollout_kv_cache_dtype" not in speedup_args(worker_config(f"{base}_offload", args))  # the default
    strip = {"name", "row", "rollout_kv_cache_dtype"}
    assert {k: v for k, v in plain.items() if k not in strip} == {
        k: v for k, v in small.items() if k not in strip
    }
    card = {"gpu_total_gib": 79.19, "shape": "llama-7b", "batch": plain["batch"], "micro": 8, "prompt_len": 128,
            "response_len": 384, "value_mode": "fused", "peft": plain["peft"], "reward": "model",
            "host_offload": "auto"}  # fmt: skip
    a, b = (
        shape_prediction({**card, "rollout_kv_cache_dtype": "model"})["choices"],
        shape_prediction({**card, "rollout_kv_cache_dtype": "int8"})["choices"],
    )
    assert (a["kv_cache_dtype"], b["kv_cache_dtype"]) == ("model dtype", "int8")
    # the default ("auto") row is predicted with PPOTrainer's choice: int8 where it generates in fewer chunks
    auto = shape_prediction(card)["choices"]
    assert auto == (b if base == "lora7b" else a)
    # what the plan from the shape expects the int8 row to change: LoRA generates at once, full fine-tuning
    # (already at once) holds the fused decode projections
    if base == "lora7b":
        assert (a["generation_rows"], b["generation_rows"]) == (128, 256)
    else:
        assert (a["generation_rows"], b["generation_rows"], a["fuse_projections"], b["fuse_projections"]) == (
            160, 160, False, True
        )  # fmt: skip
    script = (Path(__file__).resolve().parents[2] / "benchmarks/card80/h100.sh").read_text()
    assert "lora7b_kv|full7b_kv)" in script and "${base}_modelkv,${base}_int8kv" in script


def test_a_card_cap_that_is_no_card_is_refused(capsys):
    """--cap-gib plans an 80 GB card on a bigger one; a cap of no size is refused with the flag named."""
    for bad in ("-3", "0", "5000"):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", "--cap-gib", bad])
        assert "--cap-gib" in capsys.readouterr().err
    assert parse_args(["--out", "x", "--cap-gib", "79.19"]).cap_gib == 79.19


def test_the_chart_draws_a_stored_call_and_refuses_one_where_nothing_ran(tmp_path):
    from benchmarks.card80.chart import chart

    stored = (
        Path(__file__).resolve().parents[2]
        / "benchmarks"
        / "card80"
        / "results"
        / "h100_2026-12-06"
        / "full7b_trades"
        / "results.json"
    )
    png = chart(stored, tmp_path / "chart.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    data = json.loads(stored.read_text())
    for row in data["rows"]:
        row["status"] = "oom"
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="no row ran"):
        chart(tmp_path / "results.json")
    for garbage in ("not json", "[1, 2]", '{"rows": 3}'):
        (tmp_path / "bad.json").write_text(garbage)
        with pytest.raises(SystemExit, match="not a benchmarks/card80 results.json"):
            chart(tmp_path / "bad.json")
    with pytest.raises(SystemExit, match="not a benchmarks/card80 results.json"):
        chart(tmp_path / "missing.json")


def test_the_fuselora_row_differs_only_in_fusing_lora_and_reaches_the_trainer():
    """``h100.sh OUT lora7b_fuse``: LoRA b256 as the default runs it and with rollout_decode_fuse_lora=True."""
    from benchmarks.ppo_vs_trl.worker import speedup_args

    args = parse_args(["--out", "x", "--rows", "lora7b_offload,lora7b_fuselora", "--updates", "3"])
    plain, fused = worker_config("lora7b_offload", args), worker_config("lora7b_fuselora", args)
    assert speedup_args(fused)["rollout_decode_fuse_lora"] is True
    assert "rollout_decode_fuse_lora" not in speedup_args(plain)  # PPOConfig's default (False)
    strip = {"name", "row", "decode_kernels"}
    assert {k: v for k, v in plain.items() if k not in strip} == {
        k: v for k, v in fused.items() if k not in strip
    }
    script = (Path(__file__).resolve().parents[2] / "benchmarks/card80/h100.sh").read_text()
    assert "lora7b_fuse)" in script and "--rows lora7b_offload,lora7b_fuselora" in script


def test_a_profiled_update_reaches_the_worker_and_one_outside_the_run_is_refused(capsys):
    args = parse_args(["--out", "x", "--rows", "lora7b_offload", "--updates", "4", "--profile-update", "3"])
    assert worker_config("lora7b_offload", args)["profile_update"] == 3
    assert "profile_update" not in worker_config("lora7b_offload", parse_args(["--out", "x"]))
    for bad in (["--updates", "3", "--profile-update", "3"], ["--profile-update", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *bad])
        assert "--profile-update" in capsys.readouterr().err


def test_the_liger_rows_differ_only_in_the_speed_switches_and_reach_the_trainer():
    from benchmarks.ppo_vs_trl.worker import speedup_args

    args = parse_args(["--out", "x", "--rows", "lora7b_offload,lora7b_liger,lora7b_ligercompile"])
    base, liger, both = (
        worker_config(r, args) for r in ("lora7b_offload", "lora7b_liger", "lora7b_ligercompile")
    )
    strip = lambda c: {k: v for k, v in c.items() if k not in ("name", "row", "liger", "compile")}  # noqa: E731
    assert strip(base) == strip(liger) == strip(both)
    assert (liger["liger"], liger["compile"]) == (True, False) and (both["liger"], both["compile"]) == (
        True,
        True,
    )
    assert speedup_args(liger)["use_liger_kernel"] is True and "torch_compile" not in speedup_args(liger)
    assert speedup_args(both)["torch_compile"] is True
    assert "use_liger_kernel" not in speedup_args(base)


def test_the_frozen8_row_differs_only_in_the_frozen_models_bits_and_reaches_the_trainer():
    args = parse_args(["--out", "x", "--rows", "full7b_offload,full7b_frozen8"])
    base, q = worker_config("full7b_offload", args), worker_config("full7b_frozen8", args)
    strip = lambda c: {k: v for k, v in c.items() if k not in ("name", "row", "ref_quant", "reward_quant")}  # noqa: E731
    assert strip(base) == strip(q) and (q["ref_quant"], q["reward_quant"]) == ("8bit", "8bit")
    assert "ref_quant" not in base and "reward_quant" not in base


def test_the_frozen_and_liger_parts_run_their_rows_beside_the_defaults():
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "benchmarks/card80/h100.sh").read_text()
    assert "--rows full7b_offload,full7b_frozen8" in script
    assert "for base in lora7b full7b" in script and "--rows ${base}_offload,${base}_liger" in script
    known = parse_args(["--out", "x"]).rows  # the rows the parts name exist
    for row in ("full7b_offload", "full7b_frozen8", "lora7b_offload", "lora7b_liger", "full7b_liger"):
        assert worker_config(row, parse_args(["--out", "x", "--rows", row]))["row"] == row, known
