"""benchmarks/grpo/run.py --smoke: stock, rapidfire and the low-memory switch of GRPO run on the CPU and are
reported; the script's speed, ratio and phase helpers."""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmarks.loader import load_benchmark


def load_run():
    return load_benchmark("grpo/run.py", keep_on_path=True)  # run.py imports its sibling phases.py by name


def test_variants_flag_parses_and_rejects_unknown_names():
    module = load_run()
    assert module.parse_variants("stock, rapidfire_lowmem,stock") == ["stock", "rapidfire_lowmem"]
    with pytest.raises(Exception, match="unknown variant"):
        module.parse_variants("stock,lowmem")
    # every setting of the lowmem variant says where it comes from: stock TRL or rapidfire_hf
    settings = module.SETTINGS["rapidfire_lowmem"]
    assert {s["source"].split(" ")[0] for s in settings} == {"stock", "rapidfire_hf"}


def test_alwaysrelease_variants_run_the_previous_release_default_and_only_when_named():
    """'<variant>_alwaysrelease' is that variant with the memory callback releasing at every rollout (the default
    until 2026-12-04); the plain variant keeps the default ('pressure'); neither is in the default list."""
    module = load_run()
    from rapidfire_hf.integrations.parts import installed_parts

    assert module.parse_variants("rapidfire_alwaysrelease") == ["rapidfire_alwaysrelease"]
    with pytest.raises(Exception, match="unknown variant"):
        module.parse_variants("stock_alwaysrelease")
    kwargs = {"rollback": "auto", "snapshot": "host"}
    released = {}
    for name in ("rapidfire", "rapidfire_alwaysrelease"):
        trainer, _, _ = module.make_trainer(name, True, 1, kwargs)
        released[name] = installed_parts(trainer)["memory"].release_after_rollout
    assert released == {"rapidfire": "pressure", "rapidfire_alwaysrelease": "always"}


def test_speed_ratios_and_targets():
    run = load_run()
    sp = run.speed([10.0, 2.0, 3.0, 2.0], [100, 100, 120, 100])
    assert sp["all_steps"]["tokens_per_sec"] == pytest.approx(420 / 17)
    assert sp["steady_state_steps_2_on"]["tokens_per_sec"] == pytest.approx(320 / 7)
    assert sp["first_step_s"] == 10.0 and sp["median_step_s_steps_2_on"] == 2.0
    assert sp["first_step_excess_s"] == pytest.approx(8.0)
    assert run.speed([5.0], [10])["steady_state_steps_2_on"] is None

    def fake(step_s, peak):
        return {
            "tokens_per_sec": 1.0,
            "speed": run.speed(step_s, [100] * len(step_s)),
            "peak_allocated_gib": peak,
        }

    r = run.ratios_to_stock(fake([20.0, 1.0, 1.0], 5.0), fake([20.0, 6.0, 6.0], 11.0))
    assert r["tokens_per_sec_steady_state_steps_2_on"] == pytest.approx(6.0)
    assert r["tokens_per_sec_all_steps"] == pytest.approx(32 / 22)
    assert r["target_met"] == {
        "speed_steady_state_ge_3x": True,
        "speed_all_steps_ge_3x": False,
        "peak_allocated_le_half": True,
    }


def test_phase_times_add_up_per_step_on_the_cpu():
    run = load_run()
    phases = run.PhaseMemory()
    phases.start()
    for _ in range(3):
        phases.enter("generation")
        phases.exit()
        phases.enter("backward")
        sum(range(20000))
        phases.exit()
        phases.end_step()
    report = phases.time_report()
    assert len(report["per_step"]) == 3
    assert set(report["per_step"][1]["cpu_s"]) == {"generation", "backward", "other"}
    assert all(v >= 0 for step in report["per_step"] for v in step["cpu_s"].values())
    assert report["per_step"][1]["gpu_s"] == {}  # no CUDA here
    assert set(report["median_steps_2_on"]["cpu_s"]) == {"generation", "backward", "other"}


@pytest.mark.slow  # three child processes, each importing torch, transformers and trl and training 2 steps
def test_smoke_writes_rows_for_all_variants(tmp_path):
    load_run().main(["--out", str(tmp_path), "--smoke"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert "benchmarks/grpo/run.py" in results["command"] and results["date"]
    assert {"torch", "transformers", "trl", "accelerate"} <= set(results["environment"])
    runs = results["runs"]
    assert list(runs) == ["stock", "rapidfire", "rapidfire_lowmem"] == list(results["variants"])
    for name, run in runs.items():
        assert run["variant"] == name and run["steps"] == 2 and len(run["loss"]) == 2
        assert all(math.isfinite(x) for x in [*run["loss"], *run["reward"], *run["step_s"]])
        assert run["tokens_per_sec"] > 0 and run["tokens"] > 0
        speed = run["speed"]
        assert speed["all_steps"]["steps"] == 2 and speed["steady_state_steps_2_on"]["steps"] == 1
        assert speed["all_steps"]["tokens"] == run["tokens"] == sum(run["step_tokens"])
        assert speed["first_step_s"] == run["step_s"][0]
        # memory by phase: on the CPU only the calls are counted (one rollout, forward, backward a step)
        phases = run["memory_by_phase"]
        assert phases["peak_allocated_gib"] is None
        calls = {k: phases["calls"][k] for k in ("generation", "loss_forward", "backward", "optimizer_step")}
        assert calls == dict.fromkeys(calls, 2)
        times = run["time_by_phase"]
        assert len(times["per_step"]) == 2 and not times["per_step"][1]["gpu_s"]
        assert {"generation", "loss_forward", "backward"} <= set(times["median_steps_2_on"]["cpu_s"])
    # fp32 on the CPU, same weights, data and seed: the first loss agrees across variants
    assert runs["rapidfire_lowmem"]["loss"][0] == pytest.approx(runs["stock"]["loss"][0], abs=1e-5)
    assert runs["rapidfire"]["loss"][0] == pytest.approx(runs["stock"]["loss"][0], abs=1e-5)
    assert set(results["ratios_by_variant"]) == {"rapidfire", "rapidfire_lowmem"}
    ratios = results["ratios_by_variant"]["rapidfire_lowmem"]
    assert {"tokens_per_sec_all_steps", "tokens_per_sec_steady_state_steps_2_on", "target_met"} <= set(ratios)
    assert any(line.startswith("rapidfire_lowmem:") for line in results["summary"])

    info = runs["rapidfire_lowmem"]["lowmem"]
    assert info["rollback"] == "off" and info["max_grad_norm"] == 0.0
    # no clipping: every window is stepped in backward, gradients freed bucket by bucket
    assert info["optimizer_stats"]["pipelined_steps"] == 2 and not info["optimizer_stats"]["deferred_steps"]
    assert info["activation_offload"]["tensors_saved"] == 2 * 3  # 2 layers + final norm, 2 steps
    # on the CPU the inputs stay where they are (no host buffers)
    assert info["activation_offload"]["host_buffers_created"] == 0 and info["host_buffer_pool_gib"] == 0
    assert info["rollout_released_after_each_rollout"] is True
    assert runs["rapidfire_lowmem"]["host_memory"] is None  # torch's pinned allocator: CUDA only
    # bitsandbytes cannot run on the CPU: the smoke falls back to torch AdamW and says why
    assert info["optim"] == "adamw_torch" and info["inner_optimizer"] == "torch.optim.adamw.AdamW"
    assert info["optimizer_fallback"] and info["bnb_sync_skipped_on_default_stream"] is False
    assert (tmp_path / "chart.png").stat().st_size > 0
