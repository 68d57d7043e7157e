"""PPOSweep's throughput plan (``sweep/planning.py``): the training packing and the scoring chunk follow the
memory level's target, a user's ``train_rows_per_forward`` is kept, ``memory.planner: false`` keeps the
fixed rule, and the plan is made again when an update's rows change.

Budgets are stated from the plan's own probe: ``needed(rows)`` is what the planner's memory model says a
training forward of ``rows`` rows adds to what the sweep holds (the trials' first-step reserve and, with the
static engine, the decode's KV cache), so "room for 4 rows, not 12" is exact whatever the machine measures.
"""

from __future__ import annotations

import json

import pytest

from rapidfire_hf.config import ConfigError
from rapidfire_hf.memory.planner import LEVEL_TARGETS, TRAIN_PEAK_FACTOR, make_plan
from rapidfire_hf.sweep.phases import train_pack_rows
from rapidfire_hf.sweep.planning import SweepPlanner, reserve_bytes

from .helpers import TRIALS, make_sweep

# micro-batches of 4, 4 and 2 rows: one micro-step of every trial packs up to 3 x 4 rows (the largest
# micro-batch counts for each)
PACKED = 12


def _active(sweep):
    return [t for t in sweep.trials.values() if t.active]


def _needed(sweep, planner, rows: int) -> int:
    """Bytes the planner's memory model needs to train ``rows`` rows per forward (no level share)."""
    trials = _active(sweep)
    work = planner.workload(
        trials, sweep.prompt_width, sweep.args.response_length, sweep.phases.decode_rows, sweep.model,
        sweep.phases.engine.backend == "static", 4,
    )  # fmt: skip
    row = sweep.phases.row_activation_bytes(trials[0], work.tokens, sweep.prompt_width)
    cache = work.held_cache_bytes(work.rollout_rows)
    return reserve_bytes(trials) + cache + int(TRAIN_PEAK_FACTOR * row * rows)


def _plan_with(sweep, free_bytes: int, **kw):
    planner = SweepPlanner("balanced", free_bytes=free_bytes, **kw)
    return planner, planner.update(sweep.phases, _active(sweep), sweep.args, sweep.prompt_width)


@pytest.mark.usefixtures("single_thread")
def test_the_packing_follows_the_memory_target(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, TRIALS)
    share = LEVEL_TARGETS["balanced"].device_share
    roomy = int(_needed(sweep, SweepPlanner(), PACKED) / share) * 4
    planner, plan = _plan_with(sweep, roomy)
    assert plan.train_rows == PACKED and plan.fits  # every trial's micro-batch in one forward
    assert sweep.phases.train_rows == PACKED and sweep.phases.scoring_rows == plan.scoring_rows
    roomy_scoring = plan.scoring_rows
    # room for the one decode of every trial (never chunked) and one trial's micro-batch, not for three:
    # one micro-batch per forward, and a scoring chunk that fits (scoring holds no gradients: here the same)
    tight = int(max(_needed(sweep, planner, 4), plan.phase_peak_bytes["generation"]) / share) + 1
    assert _needed(sweep, planner, PACKED) > share * tight
    _, plan = _plan_with(sweep, tight)
    assert plan.train_rows == 4 and plan.fits, plan.table()
    assert sweep.phases.train_rows == 4 and plan.scoring_rows <= roomy_scoring
    assert plan.phase_peak_bytes["scoring"] <= plan.target_bytes
    assert (
        "rows" in plan.table() and plan.reasons["checkpointing"] == "a sweep does not recompute activations"
    )
    # the static engine keeps the decode's KV cache through training: room for 12 rows beside everything but
    # that cache is not room for 12 rows
    assert sweep.phases.engine.backend == "static"
    work = planner.workload(
        _active(sweep), sweep.prompt_width, sweep.args.response_length, 0, sweep.model, True, 4
    )  # fmt: skip
    cache = work.held_cache_bytes(work.rollout_rows)
    assert cache > 0
    beside = int((_needed(sweep, planner, PACKED) - cache // 2) / share)
    _, plan = _plan_with(sweep, beside)
    assert plan.train_rows < PACKED and plan.fits, plan.table()  # fewer trials per forward
    # less than one micro-batch needs: the plan says it does not fit (the OOM recovery splits later)
    _, plan = _plan_with(sweep, 1)
    assert not plan.fits and plan.train_rows == 4 and "DOES NOT FIT" in plan.table()


@pytest.mark.usefixtures("single_thread")
def test_a_users_rows_are_kept_and_the_planner_switch_keeps_the_fixed_rule(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, TRIALS)
    _, plan = _plan_with(sweep, 10**12, train_rows=5)
    assert plan.train_rows == 5 and plan.reasons["train_rows"] == "your train_rows_per_forward"
    _, plan = _plan_with(sweep, 1, train_rows=5)  # kept even where it does not fit
    assert plan.train_rows == 5 and not plan.fits
    _, plan = _plan_with(sweep, 1, planner=False)  # no probe, no budget: the rule the plan replaced
    tokens = sweep.prompt_width + sweep.args.response_length
    assert not plan.planned and plan.train_rows == train_pack_rows(tokens, 4) and plan.scoring_rows == 64


@pytest.mark.usefixtures("single_thread")
def test_rapidfire_config_sets_the_level_and_is_checked_before_the_model_loads(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path / "a", TRIALS, rapidfire_config={"memory": {"planner": False}})
    assert not sweep.planner.planner
    sweep = make_sweep(tokenizer, tmp_path / "b", TRIALS, rapidfire_config="aggressive")
    assert sweep.planner.level == "aggressive" and sweep.planner.planner
    with pytest.raises(ConfigError, match="optimization"):
        make_sweep(tokenizer, tmp_path / "c", TRIALS, rapidfire_config={"memory": {"optimization": "lots"}})


@pytest.mark.usefixtures("single_thread")
def test_the_plan_is_printed_logged_and_made_again_when_the_rows_change(tokenizer, tmp_path, capsys, caplog):
    sweep = make_sweep(tokenizer, tmp_path, TRIALS, max_steps=2)
    seen = []

    class StopAfterOne:  # stops one trial after its first update: the second update has fewer rows
        def on_step_end(self, args, state, control, sweep=None, trial=None, **kw):
            seen.append((trial, sweep.phases.train_rows))
            if trial == "kl0.01" and state.global_step == 1:
                sweep.stop(trial)

    sweep.callbacks.append(StopAfterOne())
    with caplog.at_level("INFO", logger="rapidfire_hf.sweep"):
        sweep.train()
    out = capsys.readouterr().out
    assert out.count("PPOSweep plan (memory.optimization=balanced") == 1
    assert "training rows per forward (all trials)" in out and "3 trials' micro-batches per forward" in out
    assert sweep.planner.plans == 2  # the first update's, then the one for two trials
    assert any("PPOSweep plan for 2 trial(s)" in r.getMessage() for r in caplog.records)
    assert seen[0][1] == PACKED and seen[-1][1] == 8  # two trials of micro-batches 4 and 2: 2 x 4 rows
    for name, trial in sweep.trials.items():
        first = trial.state.log_history[0]
        assert first["rapidfire/plan/train_rows"] == PACKED, name
        assert first["rapidfire/plan/scoring_rows"] >= 1
    later = sweep.trials["clip0.1"].state.log_history[1]
    assert later["rapidfire/plan/train_rows"] == 8
    summary = json.loads((tmp_path / "summary.json").read_text())  # the plan of the last update
    assert summary["plan"]["train_rows"] == 8 and summary["plan"]["title"] == "PPOSweep plan"


@pytest.mark.usefixtures("single_thread")
def test_the_reserve_counts_what_the_first_step_still_allocates(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, TRIALS, max_steps=1)  # (a PPOConfig changed after: refused)
    trials = _active(sweep)
    param_bytes = sum(p.numel() * p.element_size() for t in trials for p in t.params)
    assert param_bytes > 0
    assert reserve_bytes(trials) == 3 * param_bytes  # gradients and AdamW's two moments, none there yet
    sweep.train()  # every optimizer now has its state; gradients are freed after each step
    assert reserve_bytes(trials) == param_bytes


@pytest.mark.usefixtures("single_thread")
def test_a_probe_that_fails_falls_back_to_the_fixed_rule_with_a_warning(tokenizer, tmp_path, caplog):
    sweep = make_sweep(tokenizer, tmp_path, TRIALS)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (injected)")

    sweep.phases.row_activation_bytes = broken
    with caplog.at_level("WARNING", logger="rapidfire_hf.sweep"):
        _, plan = _plan_with(sweep, 10**12)
    assert "could not measure a training row (CUDA out of memory (injected))" in caplog.text
    tokens = sweep.prompt_width + sweep.args.response_length
    assert not plan.planned and plan.train_rows == train_pack_rows(tokens, 4)
    assert "the probe failed" in plan.reasons["train_rows"]


def test_a_sweep_files_rapidfire_config_is_checked_before_anything_loads(tmp_path):
    from rapidfire_hf.sweep.spec import validate

    doc = {"reward_funcs": ["demo"], "trials": {"a": {}}}
    config = {"output_dir": str(tmp_path), "use_cpu": True, "response_length": 4}
    for bad, says in (
        ({"memory": {"optimization": "lots"}}, "memory.optimization"),
        ("x" * 300, "unknown preset"),
    ):
        with pytest.raises(ConfigError, match="config.rapidfire_config") as err:
            validate({**doc, "config": {**config, "rapidfire_config": bad}})
        assert says in str(err.value)
    validate({**doc, "config": {**config, "rapidfire_config": {"memory": {"planner": False}}}})


@pytest.mark.usefixtures("single_thread")
def test_the_engines_kept_cache_is_counted_once_when_the_plan_is_made_again(tokenizer, tmp_path, monkeypatch):
    from rapidfire_hf.memory.planner import Budget
    from rapidfire_hf.sweep import planning

    sweep = make_sweep(tokenizer, tmp_path, TRIALS, max_steps=1)
    assert sweep.phases.engine.held_bytes() == 0  # nothing decoded yet
    sweep.train()
    engine = sweep.phases.engine.held_bytes()
    trials = list(sweep.trials.values())
    work = SweepPlanner().workload(
        trials, sweep.prompt_width, sweep.args.response_length, sweep.phases.decode_rows, sweep.model, True, 4
    )  # fmt: skip
    assert engine >= work.held_cache_bytes(work.rollout_rows) > 0  # K and V of every decoded row, and buffers
    # a device that holds the weights (1 MB) and the engine's cache, as CUDA's allocator reports it
    monkeypatch.setattr(
        planning,
        "level_budget",
        lambda device, level, reserve, free=None: Budget(10**9, 10**6 + engine, reserve),
    )
    seen = []
    monkeypatch.setattr(planning, "make_plan", lambda work, asked, probe, budget, level, **kw: seen.append(budget)
                        or make_plan(work, asked, probe, budget, level, **kw))  # fmt: skip
    for t in trials:
        t.state.global_step = 0  # active again, to plan for
    SweepPlanner().update(sweep.phases, trials, sweep.args, sweep.prompt_width)
    assert seen[0].held_bytes == 10**6  # the plan adds the decode's cache itself
    sweep.phases.engine.release()
    assert sweep.phases.engine.held_bytes() == 0


@pytest.mark.usefixtures("single_thread")
def test_the_scoring_chunk_stays_at_the_sweeps_earlier_64_rows_where_memory_allows_more(tokenizer, tmp_path):
    five = {f"t{i}": {"seed": i} for i in range(5)}  # 5 x 16 = 80 rows per update
    sweep = make_sweep(tokenizer, tmp_path, five, gradient_accumulation_steps=4)
    assert sum(t.args.local_batch_size for t in sweep.trials.values()) == 80
    _, plan = _plan_with(sweep, 10**12)
    assert plan.scoring_rows == 64 and "as before the plan" in plan.reasons["scoring_rows"]
    _, plan = _plan_with(sweep, 10**12, planner=False)
    assert plan.scoring_rows == 64


@pytest.mark.usefixtures("single_thread")
def test_any_number_of_trials_may_share_a_forward_not_only_a_divisor(tokenizer, tmp_path):
    five = {f"t{i}": {"seed": i} for i in range(5)}  # micro-batches of 4 rows: one forward packs up to 20
    sweep = make_sweep(tokenizer, tmp_path, five)
    planner = SweepPlanner()
    share = LEVEL_TARGETS["balanced"].device_share
    _, roomy = _plan_with(sweep, 10**12)
    assert roomy.train_rows == 20
    # room for 4 trials' micro-batches, not 5: 16 rows (packs of 4 + 1), not one trial per forward
    room = max(
        _needed(sweep, planner, 16), roomy.phase_peak_bytes["generation"], roomy.phase_peak_bytes["scoring"]
    )
    assert _needed(sweep, planner, 20) > room
    _, plan = _plan_with(sweep, int(room / share) + 1)
    assert plan.train_rows == 16 and plan.fits, plan.table()
