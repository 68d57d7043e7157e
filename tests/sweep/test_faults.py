"""Faults stay in their trial: no line of the control file can end a run, a trial whose numbers turn
non-finite is stopped as ``diverged`` while the others continue exactly as alone, and a failure shared by
every trial (the reward function raising) saves everything before it raises, naming the update."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from rapidfire_hf.demo import vowel_reward
from rapidfire_hf.sweep.control import CONTROL_FILE, EarlyStopping, SuccessiveHalving
from rapidfire_hf.sweep.sweep import SweepError

from .helpers import TRIALS, curves, make_sweep, max_abs_diff

A, B = "kl0.01", "kl0.2-lr3"
TWO = {A: TRIALS[A], B: TRIALS[B]}


@pytest.fixture(scope="module")
def alone(tokenizer, tmp_path_factory):
    """Trial A trained alone for 3 updates: what A must equal whatever happens to the trials beside it."""
    torch.set_num_threads(1)
    sweep = make_sweep(tokenizer, tmp_path_factory.mktemp("alone"), {A: TRIALS[A]})
    return curves(sweep.train()[A]), sweep.adapter_state_dict(A)


def _a_as_alone(sweep, alone) -> None:
    assert sweep.trials[A].status == "finished"
    assert curves(sweep.trials[A].state.log_history) == alone[0]
    assert max_abs_diff(sweep.adapter_state_dict(A), alone[1]) == 0.0


BAD_LINES = [
    b"{not json\n",
    b'{"op": "stop"}\n',
    b"\xff\xfe\xfa garbage\n",
    b'{"op": "pause", "trial": "kl0.01"}\n',
    b"[1, 2]\n",
    b'{"op": "stop", "trial": "kl0.01", "extra": 1}\n',
    b'{"op": "stop", "trial": "nope"}\n',
    b'{"op": "clone", "trial": "kl0.01", "new": "x", "overrides": {"lr_scheduler_kwargs": "oops"}}\n',
    b'{"op": "clone", "trial": "kl0.01", "new": "y", "overrides": {"lr_scheduler_type": "bogus"}}\n',
    b'{"op": "clone", "trial": "kl0.01", "new": "z", "overrides": {"temperature": 0.5}}\n',
    b'{"op": "clone", "trial": "kl0.01", "new": "../up", "overrides": {}}\n',
    b'{"op": "clone", "trial": "kl0.01", "new": "' + b"n" * 300 + b'"}\n',
    b'{"op": "resume", "trial": "kl0.01"}\n',
    b"\n",
    b'{"op": "stop", "trial": "kl0.2-lr3"}\n',  # the one good line
]


@pytest.mark.usefixtures("single_thread")
def test_no_control_line_can_end_the_run(tokenizer, tmp_path, alone, caplog):
    sweep = make_sweep(tokenizer, tmp_path, TWO)
    (tmp_path / CONTROL_FILE).write_bytes(b"".join(BAD_LINES))
    with caplog.at_level(logging.WARNING):
        results = sweep.train()
    _a_as_alone(sweep, alone)
    assert results[B].status == "stopped" and results[B].global_step == 0
    assert set(sweep.trials) == {A, B}  # no clone half made
    assert sweep.bank.slots == [sweep.trials[A].slot, sweep.trials[B].slot]  # no adapter left behind
    text = caplog.text
    for line, words in [(1, "is not JSON"), (2, 'needs "trial"'), (3, "is not UTF-8"), (4, "unknown op 'pause'"),
                        (5, "is a JSON list"), (6, "keys a stop command does not take: extra"),
                        (7, "no trial named 'nope'"), (8, "lr_scheduler_kwargs takes a mapping"),
                        (9, "bogus"), (10, "'temperature' is shared"), (11, "not allowed"),
                        (12, "characters long"), (13, "only a stopped trial can be resumed")]:  # fmt: skip
        assert f"line {line}" in text and words in text, (line, words)
    state = json.loads((tmp_path / "sweep_state.json").read_text())
    assert state["status"] == "finished" and len(state["messages"]) == 7  # the ones the sweep refused


def _reward_failing_at(update: int):
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == update:
            raise RuntimeError("the reward server is down")
        return vowel_reward(prompts=prompts, completions=completions, **kwargs)

    return reward


@pytest.mark.usefixtures("single_thread")
def test_a_shared_failure_saves_everything_then_raises_naming_the_update(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, TWO)
    sweep.phases.reward_funcs = [_reward_failing_at(3)]
    with pytest.raises(
        SweepError, match=r"failed at update 3, in scoring.*RuntimeError: the reward server is down"
    ) as err:
        sweep.train()
    assert "resume_from_checkpoint=True" in str(err.value)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["trials"][A]["updates"] == 2
    for name in TWO:  # every trial's state at the last boundary, its history and its checkpoint
        assert len(json.loads((tmp_path / "trials" / name / "log_history.json").read_text())) == 2
        assert (tmp_path / "trials" / name / "checkpoint-2" / "checkpoint_manifest.json").is_file()
    # and the saved state resumes into the run that never failed
    whole = make_sweep(tokenizer, tmp_path / "whole", TWO)
    whole.train()
    again = make_sweep(tokenizer, tmp_path, TWO)
    again.train(resume_from_checkpoint=True)
    for name in TWO:
        assert curves(again.trials[name].state.log_history) == curves(whole.trials[name].state.log_history)
        assert max_abs_diff(again.adapter_state_dict(name), whole.adapter_state_dict(name)) == 0.0


def _nan_rewards_for_b_at(update: int):
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append(1)
        scores = vowel_reward(prompts=prompts, completions=completions, **kwargs)
        if len(calls) == update:  # B's rows are the second block of 8
            scores = [math.nan if 8 <= i < 16 else s for i, s in enumerate(scores)]
        return scores

    return reward


def _poison_value_head(sweep):
    with torch.no_grad():
        sweep.trials[B].value_head.summary.weight.fill_(float("nan"))


def _nan_values(sweep):
    """The value head's output turns NaN while its weights stay finite."""
    sweep.trials[B].value_head.register_forward_hook(lambda module, args, out: out * math.nan)


def _poison_adapter(sweep):
    with torch.no_grad():
        sweep.bank.parameters(sweep.trials[B].slot)[1].fill_(float("inf"))


def _learning_rate(lr):
    def poison(sweep):
        sweep.trials[B].optimizer.param_groups[0]["lr"] = lr

    return poison


FAULTS = [
    ("nan_rewards", lambda s: setattr(s.phases, "reward_funcs", [_nan_rewards_for_b_at(2)]), 2, "rewards"),
    ("nan_values", _nan_values, 1, "values (the value head) (after scoring)"),
    ("nan_value_head", _poison_value_head, 1, "value head weights (before the rollout)"),
    ("inf_adapter", _poison_adapter, 1, "adapter weights (before the rollout)"),
    # the first step (lr 1e30) makes the weights huge but finite; the finite-step guard then skips the
    # windows whose loss is not finite (before issue 28 item 4 they reached the weights as NaN, and pg_loss
    # was the first non-finite statistic); the value loss of the huge value head is the one left
    ("inf_step", _learning_rate(1e30), 1, "non-finite vf_loss (in the PPO epochs)"),
    ("raising_step", _learning_rate(1e39), 1, "optimizer step raised RuntimeError"),
]


@pytest.mark.parametrize(("poison", "update", "words"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
@pytest.mark.usefixtures("single_thread")
def test_a_diverged_trial_stops_and_the_others_continue(tokenizer, tmp_path, alone, poison, update, words):
    sweep = make_sweep(tokenizer, tmp_path, TWO, save_strategy="steps", save_steps=1)
    poison(sweep)
    results = sweep.train()
    _a_as_alone(sweep, alone)
    b = sweep.trials[B]
    assert results[B].status == "diverged" and b.state.global_step == update - 1
    assert b.reason.startswith(f"update {update}: ") and words in b.reason
    assert all(math.isfinite(v) for h in b.state.log_history for v in h.values() if isinstance(v, float))
    summary = json.loads((tmp_path / "summary.json").read_text())["trials"][B]
    assert summary["state"] == "diverged" and summary["reason"] == b.reason
    saved = sorted(p.name for p in (tmp_path / "trials" / B).glob("checkpoint-*"))
    assert saved == [f"checkpoint-{u}" for u in range(1, update)]  # nothing non-finite is ever saved


def _fake(name, scores, status="running", step=3):
    history = [{"objective/scores": s, "step": i + 1} for i, s in enumerate(scores)]
    state = SimpleNamespace(log_history=history, global_step=step)
    return SimpleNamespace(name=name, state=state, status=status, active=status == "running")


def test_early_stopping_ignores_non_finite_trials():
    rule = EarlyStopping(after_updates=1, margin=0.1, window=1)
    trials = {"nan": _fake("nan", [math.nan]), "good": _fake("good", [1.0]), "bad": _fake("bad", [0.5])}
    assert rule.check(trials) == [("bad", "objective/scores 0.5 is 0.5 behind the best 1")]
    trials = {"inf": _fake("inf", [math.inf]), "good": _fake("good", [1.0]), "bad": _fake("bad", [0.5])}
    assert [n for n, _ in rule.check(trials)] == ["bad"]
    trials["good"].status = "diverged"
    assert rule.check(trials) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"margin": "lots"}, "margin must be a finite number"),
        ({"margin": math.nan}, "margin must be a finite number"),
        ({"after_updates": 0}, "after_updates must be an integer >= 1"),
        ({"window": 1.5}, "window must be an integer"),
        ({"metric": 3}, "metric must be a metric name"),
        ({"mode": "best"}, "allowed 'max' or 'min'"),
    ],
)
def test_early_stopping_refuses_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)


def test_successive_halving_keeps_the_best_fraction_at_each_rung():
    rule = SuccessiveHalving(rungs=(2, 4), keep=0.5, window=1)
    trials = {n: _fake(n, [0.0, s], step=2) for n, s in [("a", 0.4), ("b", 0.9), ("c", math.nan), ("d", 0.1)]}
    stopped = dict(rule.check(trials))
    assert set(stopped) == {"c", "d"}  # b and a kept; the NaN ranks last
    assert "successive halving at update 2" in stopped["d"] and "ranks 4 of 4" in stopped["c"]
    assert rule.decisions == [{"update": 2, "kept": ["b", "a"], "stopped": ["d", "c"]}]
    for n in ("c", "d"):
        trials[n].status, trials[n].active = "early_stopped", False
    assert rule.check(trials) == []  # judging rung 2 again stops nobody new
    for n in ("a", "b"):
        trials[n].state.global_step = 4
        trials[n].state.log_history.append({"objective/scores": -1.0 if n == "a" else 1.0, "step": 4})
    trials["a"].pinned = True
    assert rule.check(trials) == []  # rung 4: a ranks last but was resumed by hand
    trials["a"].pinned = False
    assert [n for n, _ in rule.check(trials)] == ["a"]
    with pytest.raises(ValueError, match="keep must be a fraction"):
        SuccessiveHalving(keep=1)
    with pytest.raises(ValueError, match="increasing update counts"):
        SuccessiveHalving(rungs=(4, 2))


@pytest.mark.usefixtures("single_thread")
def test_successive_halving_in_a_sweep(tokenizer, tmp_path):
    trials = {f"kl{k}": {"kl_coef": k, "seed": i} for i, k in enumerate((0.01, 0.05, 0.1, 0.2))}
    sweep = make_sweep(tokenizer, tmp_path, trials, max_steps=3)
    sweep.early_stopping = SuccessiveHalving(rungs=(1, 2), keep=0.5)
    results = sweep.train()
    updates = sorted(r.global_step for r in results.values())
    assert updates == [1, 1, 2, 3]  # half stop at update 1, half of the rest at update 2
    assert [r.status for r in results.values()].count("finished") == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [d["update"] for d in summary["decisions"]] == [1, 2]


@pytest.mark.usefixtures("single_thread")
def test_a_trial_diverged_mid_run_is_never_saved(tokenizer, tmp_path):
    """Without save_steps every trial is checkpointed at the end: never the diverged one's weights."""

    class Overflow:
        def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
            if trial == B and state.global_step == 1:
                sweep.trials[B].optimizer.param_groups[0]["lr"] = 1e30

    sweep = make_sweep(tokenizer, tmp_path, TWO)
    sweep.callbacks.append(Overflow())
    results = sweep.train()
    assert results[B].status == "diverged" and results[B].global_step == 1
    assert not list((tmp_path / "trials" / B).glob("checkpoint-*"))
    assert [p.name for p in (tmp_path / "trials" / A).glob("checkpoint-*")] == ["checkpoint-3"]


def test_a_clone_that_cannot_be_built_leaves_nothing_behind(tokenizer, tmp_path, monkeypatch):
    import rapidfire_hf.sweep.sweep as sweep_module

    sweep = make_sweep(tokenizer, tmp_path, {A: TRIALS[A]})
    slots = list(sweep.bank.slots)

    def failing_build(name, args, overrides, bank, slot, *rest):
        bank.add(slot, seed=0)
        raise RuntimeError("out of memory while building the trial")

    monkeypatch.setattr(sweep_module, "build_trial", failing_build)
    with pytest.raises(RuntimeError, match="out of memory"):
        sweep.clone(A, "copy")
    assert list(sweep.trials) == [A] and sweep.bank.slots == slots


@pytest.mark.usefixtures("single_thread")
def test_ctrl_c_saves_then_stops(tokenizer, tmp_path):
    class CtrlC:
        def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
            if trial == B and state.global_step == 2:
                raise KeyboardInterrupt

    sweep = make_sweep(tokenizer, tmp_path, TWO)
    sweep.callbacks.append(CtrlC())
    with pytest.raises(KeyboardInterrupt):
        sweep.train()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    for name in TWO:
        assert (tmp_path / "trials" / name / "checkpoint-2" / "checkpoint_manifest.json").is_file()
