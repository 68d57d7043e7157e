"""benchmarks/precision/ppo_ratio.py --smoke: three precision modes of one PPO run on CPU, finite rows."""

from __future__ import annotations

import csv
import json
import math

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.mark.slow  # 24 s on a 2-core CPU
def test_ppo_ratio_smoke(tmp_path):
    module = load_benchmark("precision/ppo_ratio.py")
    module.main(["--out", str(tmp_path), "--smoke"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "ppo_ratio.png").stat().st_size > 0
    assert {"gpu", "torch", "transformers", "date", "command"} <= set(results["env"])
    settings = results["settings"]
    assert set(results["modes"]) == {"bf16", "adaptive", "fp32"}
    numeric = [k for k in module.CSV_KEYS if k not in ("mode", "update", "probe_aligned")]
    for mode, run in results["modes"].items():
        rows = run["rows"]
        assert [r["update"] for r in rows] == list(range(1, settings["updates"] + 1)), mode
        for row in rows:
            assert row["probe_aligned"], (mode, row)
            for key in numeric:
                assert row[key] is not None and math.isfinite(row[key]), (mode, key, row[key])
            assert 0 < row["first_mb_tokens"] <= settings["micro"] * settings["response_len"]
            assert row["first_mb_ratio_max_dev"] >= 0 and row["first_mb_ratio_std"] >= 0
            assert len(row["ratio_max_dev_by_epoch"]) == settings["ppo_epochs"]

    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 3 * settings["updates"] and set(csv_rows[0]) == set(module.CSV_KEYS)

    # what the modes are: bf16 everywhere; adaptive = bf16 body, fp32 norm + head (policy and reference)
    modes = results["modes"]
    assert set(modes["bf16"]["dtypes"].values()) == {"torch.bfloat16"}
    assert modes["adaptive"]["dtypes"] == {
        "policy_body": "torch.bfloat16",
        "lm_head": "torch.float32",
        "final_norm": "torch.float32",
        "reference_lm_head": "torch.float32",
    }
    assert modes["adaptive"]["plugin"]["layer_precision"] == {
        "policy.model.norm": "fp32",
        "policy.lm_head": "fp32",
    }
    assert modes["adaptive"]["sensitivity"]  # the sensitivity pass ran and reported every layer

    # before any optimizer step fp32 rollout and training log-probs agree to fp32 rounding, bf16 ones to bf16
    # rounding. On this CPU stack (torch 2.13, transformers 5.24 / 5.25) the tiny model's bf16 gap came out below
    # fp32's (6.7e-8 against 1.6e-7; the previous session's stack gave over 10x fp32's), so their order is not
    # asserted here; on an H200 bf16 gave 4.5e-3 against fp32's 7.2e-7 (results/h200/ppo_ratio_three_modes)
    fp32_gap = modes["fp32"]["rows"][0]["logprob_gap_abs_mean"]
    bf16_gap = modes["bf16"]["rows"][0]["logprob_gap_abs_mean"]
    assert fp32_gap < 1e-5 and bf16_gap < 2**-7
    # the policy does move within an update: the last epoch's ratios are far from 1
    assert all(r["last_epoch_ratio_max_dev"] > r["first_mb_ratio_max_dev"] for r in modes["fp32"]["rows"])
