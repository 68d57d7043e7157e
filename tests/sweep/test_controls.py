"""Stop / resume / clone at update boundaries, from a callback and from the control file, and early
stopping: a resumed trial continues as if never stopped; a clone starts from its parent's state."""

from __future__ import annotations

import pytest

from rapidfire_hf.sweep import EarlyStopping, append_command

from .helpers import TRIALS, curves, make_sweep, max_abs_diff

A, B = "kl0.01", "kl0.2-lr3"
TWO = {A: TRIALS[A], B: TRIALS[B]}


class _Script:
    """A TrainerCallback-style hook that runs ``actions[(trial, step)](sweep)`` at that trial's step end."""

    def __init__(self, actions):
        self.actions = actions

    def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
        action = self.actions.get((trial, state.global_step))
        if action is not None:
            action(sweep)


@pytest.fixture(scope="module")
def alone(tokenizer, tmp_path_factory):
    """Trial A trained alone for 3 updates: what every control test must reproduce."""
    sweep = make_sweep(tokenizer, tmp_path_factory.mktemp("alone"), {A: TRIALS[A]})
    result = sweep.train()[A]
    return result, sweep.adapter_state_dict(A)


@pytest.mark.usefixtures("single_thread")
def test_stopped_and_resumed_trial_continues_as_if_never_stopped(tokenizer, tmp_path, alone):
    script = _Script({(A, 1): lambda s: s.stop(A), (B, 2): lambda s: s.resume(A)})
    sweep = make_sweep(tokenizer, tmp_path, TWO)
    sweep.callbacks.append(script)
    results = sweep.train()
    assert results[A].global_step == 3 and results[A].status == "finished"
    assert curves(results[A]) == curves(alone[0])
    assert max_abs_diff(sweep.adapter_state_dict(A), alone[1]) == 0.0


@pytest.mark.usefixtures("single_thread")
def test_clone_starts_from_the_parent_state(tokenizer, tmp_path, alone):
    script = _Script({(A, 1): lambda s: (s.clone(A, "copy"), s.clone(A, "fast", learning_rate=1e-2))})
    sweep = make_sweep(tokenizer, tmp_path, {A: TRIALS[A]})
    sweep.callbacks.append(script)
    results = sweep.train()
    assert results["copy"].parent == A and results["copy"].global_step == 3
    # a clone without overrides is its parent continued: the same updates 2 and 3, the same weights
    assert curves(results["copy"]) == curves(alone[0])
    assert max_abs_diff(sweep.adapter_state_dict("copy"), alone[1]) == 0.0
    # with another learning rate it shares update 1 (the parent's) and parts afterwards
    fast = curves(results["fast"])["loss/value_avg"]
    assert fast[0] == curves(alone[0])["loss/value_avg"][0]
    assert fast[1:] != curves(alone[0])["loss/value_avg"][1:]
    assert results["fast"].log_history[-1]["lr"] != results[A].log_history[-1]["lr"]
    # the chart draws the clone from its branch point (update 1) on, not the parent's update 1 again
    from rapidfire_hf.sweep.outputs import curve

    fast = sweep.trials["fast"]
    assert fast.branch_step == 1 and [u for u, _ in curve(fast, "objective/scores")] == [1, 2, 3]
    fast.branch_step = 2  # as if cloned after update 2: its line starts there
    assert [u for u, _ in curve(fast, "objective/scores")] == [2, 3]
    clone_at_0 = make_sweep(tokenizer, tmp_path / "c0", {A: TRIALS[A]}, max_steps=1)
    clone_at_0.clone(A, "b")
    assert clone_at_0.trials["b"].branch_step == 0


@pytest.mark.usefixtures("single_thread")
def test_control_file_commands(tokenizer, tmp_path):
    append_command(tmp_path, "stop", B)  # written before the sweep exists: ignored
    sweep = make_sweep(tokenizer, tmp_path, TWO)
    append_command(tmp_path, "stop", A)
    append_command(tmp_path, "clone", A, new="a-clone", overrides={"kl_coef": 0.5})
    results = sweep.train()
    assert results[A].status == "stopped" and results[A].global_step == 0
    assert results[B].status == "finished" and results[B].global_step == 3
    assert results["a-clone"].global_step == 3 and sweep.trials["a-clone"].args.kl_coef == 0.5


def test_control_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown sweep command"):
        append_command(tmp_path, "pause", A)
    sweep = make_sweep(tokenizer, tmp_path, {A: TRIALS[A]})
    with pytest.raises(KeyError, match="no trial named 'nope'"):
        sweep.stop("nope")
    with pytest.raises(ValueError, match="exists already"):
        sweep.clone(A, A)


@pytest.mark.usefixtures("single_thread")
def test_early_stopping_stops_the_trial_behind(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, TWO)
    sweep.early_stopping = EarlyStopping(metric="objective/scores", after_updates=1, margin=0.0, window=1)
    results = sweep.train()
    stopped = [n for n, r in results.items() if r.status == "early_stopped"]
    assert len(stopped) == 1 and results[stopped[0]].global_step == 1
    assert "behind the best" in sweep.trials[stopped[0]].reason
