"""benchmarks/presets/run.py --smoke runs its rows on the CPU and records what each row ran with."""

from __future__ import annotations

import json

import pytest

from benchmarks.presets.run import main, parse_args, pipeline_row


def test_pipeline_rows_parse_and_unknown_rows_are_refused(capsys):
    assert pipeline_row("pipeline-a4") == (True, 4) and pipeline_row("nopipeline-a8") == (False, 8)
    assert pipeline_row("pipeline-a0") is None and pipeline_row("pipeline-x") is None
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--rows", "pipeline-a0"])
    assert "unknown row(s) pipeline-a0" in capsys.readouterr().err
    for bad in ("0", "4"):  # the warm-up update, and one past the 4 updates: refused, not silently unprofiled
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", "--rows", "none", "--profile-update", bad])
        assert "--profile-update" in capsys.readouterr().err


@pytest.mark.slow  # three tiny PPO runs in worker processes (~30 s)
def test_decode_suffix_rows_set_the_attention_and_bad_suffixes_are_refused(capsys):
    from benchmarks.presets.run import row_config

    args = parse_args(["--out", "x", "--rows", "aggressive+tattn,aggressive+sdpa,none"])
    cfg = row_config("aggressive+tattn", args)
    assert cfg["decode_kernels"] == "tattn" and cfg["row"] == "aggressive+tattn"
    assert cfg["rapidfire_config"] == row_config("aggressive", args)["rapidfire_config"]
    assert "decode_kernels" not in row_config("none", args)
    from benchmarks.ppo_vs_trl.worker import speedup_args

    assert speedup_args(row_config("aggressive+freecache", args))["rollout_cache"] == "auto"
    assert "rollout_cache" not in speedup_args(row_config("aggressive", args))
    for bad in ("aggressive+flash", "trl+sdpa", "nonsense+tattn"):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", "--rows", bad])
        assert f"unknown row(s) {bad}" in capsys.readouterr().err


def test_memory_flag_rows_keep_their_config_and_change_only_the_memory_setting():
    from benchmarks.presets.run import rapidfire_config
    from rapidfire_hf.config import load_config

    for name in ("balanced", "aggressive", "advanced", "snippet"):
        plain, flagged = (
            load_config(rapidfire_config(name)),
            load_config(rapidfire_config(f"{name}-pressurerelease")),
        )
        assert flagged.memory.release_after_rollout.value == "pressure"
        a, b = plain.to_dict(), flagged.to_dict()
        b["memory"]["release_after_rollout"] = a["memory"]["release_after_rollout"]
        assert a == b, name  # nothing else differs
    assert load_config(rapidfire_config("aggressive-noplan")).memory.planner is False


def test_smoke_pipeline_rows_run_the_split_and_the_pipeline_they_name(tmp_path):
    main(["--out", str(tmp_path), "--smoke", "--rows", "nopipeline-a4,pipeline-a4,pipeline-a1"])
    rows = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())["summary"]}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    assert (rows["pipeline-a4"]["micro"], rows["pipeline-a1"]["micro"]) == (2, 8)  # smoke batch 8
    assert rows["pipeline-a4"]["pipeline"] is True and rows["nopipeline-a4"]["pipeline"] is False
    # the planner is off in these rows: the forward takes the user's micro-batch
    assert rows["pipeline-a4"]["plan_train_rows"] == 2
    assert (tmp_path / "presets.png").stat().st_size > 0


@pytest.mark.slow  # one tiny PPO run in a worker process (~15 s)
def test_profiled_update_is_summarised_and_kept_out_of_the_medians(tmp_path):
    main(["--out", str(tmp_path), "--smoke", "--rows", "conservative", "--profile-update", "2"])
    row = json.loads((tmp_path / "results.json").read_text())["rows"][0]
    assert row["status"] == "ok"
    profile, profiled = row["profile"], row["profiled_update"]
    assert profile["top"] and all(op["self_ms"] >= 0 and op["count"] >= 1 for op in profile["top"])
    assert any(op["name"] == "aten::mm" for op in profile["top"])  # the matmuls of a PPO update
    # the profiled update (0-based index 2 of 3) is out of the timed lists: 2 remain, its time apart
    assert len(row["update_times"]) == 2 and profiled["update_times"] * 1e3 >= 0.9 * profile["wall_ms"]


def test_release_suffix_sets_the_memory_callback_of_a_row_without_a_config():
    """'none+alwaysrelease' is the run without a config under the previous default (the release at every
    update); plain 'none' keeps the default ('pressure'), and the suffix changes no PPOConfig field."""
    from benchmarks.ppo_vs_trl.worker import build_ours, speedup_args
    from benchmarks.presets.run import row_config

    args = parse_args(["--out", "x", "--smoke", "--rows", "none+alwaysrelease"])
    always, plain = row_config("none+alwaysrelease", args), row_config("none", args)
    assert speedup_args(always) == speedup_args(plain)
    released = {}
    for cfg in (always, plain):
        trainer = build_ours({**cfg, "device": "cpu"}, "cpu")
        released[cfg["row"]] = trainer.memory_callback.release_after_rollout
    assert released == {"none+alwaysrelease": "always", "none": "pressure"}
