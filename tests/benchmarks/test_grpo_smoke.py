"""benchmarks/grpo/run.py --smoke: stock, rapidfire and the four rapidfire_lowmem variants of GRPO run on
CPU and are reported."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tests.bench_loader import load_benchmark


def load_run():
    return load_benchmark("grpo/run.py", keep_on_path=True)  # run.py imports lowmem at call time


def test_variants_flag_parses_and_rejects_unknown_names():
    module = load_run()
    assert module.parse_variants("stock, rapidfire_lowmem,stock") == ["stock", "rapidfire_lowmem"]
    with pytest.raises(Exception, match="unknown variant"):
        module.parse_variants("stock,lowmem")
    # every setting of the lowmem variant says where it comes from: stock TRL or rapidfire_hf
    settings = module.lowmem_settings("bitsandbytes is not installed", keep_rollout_cache=False)
    assert all(s["source"].startswith(("stock TRL", "rapidfire_hf")) for s in settings)
    assert settings[0]["setting"] == 'GRPOConfig(optim="adamw_torch")' and settings[0]["fallback"]
    assert module.lowmem_settings(None, False)[0]["setting"] == 'GRPOConfig(optim="adamw_8bit")'


@pytest.mark.slow  # six child processes, each importing torch, transformers and trl and training 2 steps
def test_smoke_writes_rows_for_all_variants(tmp_path):
    load_run().main(["--out", str(tmp_path), "--smoke"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert "benchmarks/grpo/run.py" in results["command"] and results["date"]
    runs = results["runs"]
    assert list(runs) == [
        "stock",
        "rapidfire",
        "rapidfire_lowmem",
        "rapidfire_lowmem2",
        "rapidfire_lowmem3",
        "rapidfire_lowmem4",
    ]
    assert list(results["variants"]) == list(runs)
    for name, run in runs.items():
        assert run["variant"] == name and run["steps"] == 2 and len(run["loss"]) == 2
        assert all(math.isfinite(x) for x in [*run["loss"], *run["reward"], *run["step_s"]])
        assert run["tokens_per_sec"] > 0 and run["tokens"] > 0
        # speed over all steps and over steps 2.., labelled; the first step's time on its own
        speed = run["speed"]
        assert speed["all_steps"]["steps"] == 2 and speed["steady_state_steps_2_on"]["steps"] == 1
        assert speed["all_steps"]["tokens"] == run["tokens"] == sum(run["step_tokens"])
        assert speed["first_step_s"] == run["step_s"][0]
        # memory by phase: on the CPU only the calls are counted (one rollout, forward, backward a step)
        phases = run["memory_by_phase"]
        assert phases["peak_allocated_gib"] is None
        assert {
            k: phases["calls"][k] for k in ("generation", "loss_forward", "backward", "optimizer_step")
        } == {
            "generation": 2,
            "loss_forward": 2,
            "backward": 2,
            "optimizer_step": 2,
        }
        # time by phase: host seconds per step for every phase the step went through (no CUDA here)
        times = run["time_by_phase"]
        assert len(times["per_step"]) == 2 and not times["per_step"][1]["gpu_s"]
        assert {"generation", "loss_forward", "backward"} <= set(times["median_steps_2_on"]["cpu_s"])
    # fp32 on the CPU, same weights, data and seed: the first loss agrees across variants
    assert runs["rapidfire_lowmem"]["loss"][0] == pytest.approx(runs["stock"]["loss"][0], abs=1e-5)
    assert runs["rapidfire_lowmem2"]["loss"][0] == pytest.approx(runs["stock"]["loss"][0], abs=1e-5)
    assert runs["rapidfire_lowmem3"]["loss"][0] == pytest.approx(runs["stock"]["loss"][0], abs=1e-5)
    # lowmem4 changes no math against lowmem3: the same losses on the CPU
    assert runs["rapidfire_lowmem4"]["loss"] == pytest.approx(runs["rapidfire_lowmem3"]["loss"], abs=1e-6)
    assert set(results["ratios_by_variant"]) == {
        "rapidfire",
        "rapidfire_lowmem",
        "rapidfire_lowmem2",
        "rapidfire_lowmem3",
        "rapidfire_lowmem4",
    }
    assert results["ratios"] == results["ratios_by_variant"]["rapidfire"]
    ratios = results["ratios_by_variant"]["rapidfire_lowmem2"]
    assert {"tokens_per_sec_all_steps", "tokens_per_sec_steady_state_steps_2_on", "target_met"} <= set(ratios)
    assert any(line.startswith("rapidfire_lowmem2:") for line in results["summary"])

    low = runs["rapidfire_lowmem"]
    assert any("RapidFireOptimizer" in part for part in low["installed"])
    assert any("MemoryCompactionCallback (aggressive)" in part for part in low["installed"])
    info = low["lowmem"]
    assert (
        info["rollback"] == "off" and info["gradient_pipeline"] and info["gradient_accumulation_steps"] == 1
    )
    assert info["checkpointing_applied"] == "full" and info["checkpointing_on_after_training"]
    assert info["rollout_cache_released_after_each_rollout"] is True
    if importlib.util.find_spec("bitsandbytes") is None:  # the CPU smoke falls back and says so
        assert info["optim"] == "adamw_torch" and info["inner_optimizer"] == "torch.optim.adamw.AdamW"
        assert info["optimizer_fallback"] == "bitsandbytes is not installed"
    settings = results["variants"]["rapidfire_lowmem"]["settings"]
    assert settings[0]["fallback"] == info["optimizer_fallback"]
    assert {s["source"].split(" ")[0] for s in settings} == {"stock", "rapidfire_hf"}
    # with clipping on and rollback off, every window of the old variant was deferred (gradients held)
    assert info["optimizer_stats"]["pipelined_steps"] == 0
    assert info["optimizer_stats"]["deferred_steps"] == {"clip_may_bind": 2}

    low2 = runs["rapidfire_lowmem2"]["lowmem"]
    assert low2["max_grad_norm"] == 0.0 and low2["rollback"] == "off"
    assert low2["optimizer_stats"]["pipelined_steps"] == 2 and not low2["optimizer_stats"]["deferred_steps"]
    assert low2["checkpointing_applied"].startswith("chunked") and not low2["checkpointing_on_after_training"]
    assert low2["activation_offload"]["tensors_saved"] == 2 * 3  # 2 layers + final norm, 2 steps
    assert low2["optimizer_state_offload"]["rollouts"] == 2
    assert low2["rollout_cache_released_after_each_rollout"] is True
    settings2 = results["variants"]["rapidfire_lowmem2"]["settings"]
    assert {s["source"].split(" ")[0] for s in settings2} == {"stock", "rapidfire_hf"}
    low3 = runs["rapidfire_lowmem3"]["lowmem"]
    assert low3["max_grad_norm"] == 0.0 and low3["optimizer_stats"]["pipelined_steps"] == 2
    assert low3["checkpointing_applied"].startswith("chunked, 16 sequences per backward chunk, 32")
    assert "optimizer_state_offload" not in low3  # the state stays where it is
    assert low3["activation_offload"]["tensors_saved"] == 2 * 3
    assert len(low3["rollout_hook_seconds"]["engine_s"]) == 2
    settings3 = results["variants"]["rapidfire_lowmem3"]["settings"]
    assert any("chunk_prefill" in s["setting"] for s in settings3)
    assert any(line.startswith("rapidfire_lowmem3:") for line in results["summary"])
    low4 = runs["rapidfire_lowmem4"]["lowmem"]
    assert low4["reuse_host_buffers"] is True and low4["inner_optimizer_paged"] is False
    assert low4["checkpointing_applied"] == low3["checkpointing_applied"]
    # on the CPU the inputs stay where they are (no host buffers); the bitsandbytes patch needs its optimizer
    assert low4["activation_offload"]["host_buffers_created"] == 0 and low4["host_buffer_pool_gib"] == 0
    assert low4["bnb_sync_skipped_on_default_stream"] is False  # the CPU smoke falls back to adamw_torch
    assert runs["rapidfire_lowmem4"]["host_memory"] is None  # torch's pinned allocator: CUDA only
    settings4 = results["variants"]["rapidfire_lowmem4"]["settings"]
    assert any("reuse_host_buffers=True" in s["setting"] for s in settings4)
    assert any("skip_bitsandbytes_sync_on_default_stream" in s["setting"] for s in settings4)
    assert any(line.startswith("rapidfire_lowmem4:") for line in results["summary"])
    assert (tmp_path / "chart.png").stat().st_size > 0
