"""Resuming a sweep: after a SIGKILL at any point of a save or of an update, a resumed sweep equals the
uninterrupted one (CPU fp32, bit-exact) and really starts from the checkpoints (it runs only the missing
updates); a clone comes back from its own checkpoint; a damaged or hostile checkpoint or index is refused
with the file named; a finished sweep extends with more updates.

A damaged checkpoint of one trial never blocks the others: that trial resumes from its newest checkpoint that
verifies (said), or is marked ``damaged`` when none does. A damaged index, or a checkpoint of another run or
with other settings, refuses the whole resume before any trial changes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidfire_hf.checkpoint.manifest import MANIFEST
from rapidfire_hf.sweep.checkpoint import INDEX, SweepCheckpointError
from tests.helpers.faults_io import reseal

from .crash import CLONE, A, B, CountUpdates, crash_sweep
from .helpers import TRIALS, curves, make_sweep, max_abs_diff

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(sweep) -> dict:
    return {
        n: (curves(t.state.log_history), sweep.adapter_state_dict(n), t.value_head.state_dict(), t.status)
        for n, t in sweep.trials.items()
    }


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name
        assert max_abs_diff(a[name][1], b[name][1]) == 0.0, name
        assert max_abs_diff(a[name][2], b[name][2]) == 0.0, name
        assert a[name][3] == b[name][3], name


def _updates(sweep) -> int:
    return next(cb for cb in sweep.callbacks if isinstance(cb, CountUpdates)).updates


@pytest.fixture(scope="module")
def uninterrupted(tokenizer, tmp_path_factory):
    torch.set_num_threads(1)
    sweep = crash_sweep(tokenizer, tmp_path_factory.mktemp("whole"))
    sweep.train()
    assert _updates(sweep) == 4 + 4 + 2  # A, B, and the clone from update 3 on
    return _snapshot(sweep)


# (where, target, n, updates left): killed mid-file-set of A's checkpoint-3; before B's checkpoint-3 folder
# is renamed into place (A's is then of a save the kill cut short); before the index of update 2's save
# replaces the old one (the index is written twice at the start, then at each save and for the clone); before
# the index listing the clone; in the PPO epochs of update 4. A resume starts from the last complete save
# (every trial's checkpoint of one update, journaled) and takes the same decisions again: the clone too.
KILLS = [
    ("save", "optimizer.pt", 6, 2 + 2 + 2),
    ("replace", "checkpoint-3", 2, 2 + 2 + 2),
    ("replace", INDEX, 4, 3 + 3 + 2),
    ("replace", INDEX, 5, 2 + 2 + 2),
    ("optimize", "-", 4, 1 + 1 + 1),
]


@pytest.mark.parametrize(
    ("where", "target", "n", "left"), KILLS, ids=[f"{k[0]}-{k[1]}-{k[2]}" for k in KILLS]
)
@pytest.mark.usefixtures("single_thread")
def test_resume_after_sigkill_equals_the_uninterrupted_sweep(
    tokenizer, tmp_path, uninterrupted, where, target, n, left
):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "tests.sweep.crash", str(tmp_path), where, target, str(n)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == -9, run.stderr[-2000:]  # killed, not finished
    resumed = crash_sweep(tokenizer, tmp_path)
    resumed.train(resume_from_checkpoint=True)
    _same(_snapshot(resumed), uninterrupted)
    assert _updates(resumed) == left  # only the updates the checkpoints lacked were run again


@pytest.mark.usefixtures("single_thread")
def test_finished_sweep_extends_from_its_checkpoints(tokenizer, tmp_path):
    flat = dict(lr_scheduler_type="constant")  # the schedule does not depend on the total
    straight = make_sweep(tokenizer, tmp_path / "straight", {A: TRIALS[A]}, max_steps=3, **flat)
    straight.train()
    short = make_sweep(tokenizer, tmp_path / "ext", {A: TRIALS[A]}, max_steps=2, **flat)
    assert short.train()[A].status == "finished"
    longer = make_sweep(tokenizer, tmp_path / "ext", {A: TRIALS[A]}, max_steps=3, **flat)
    counter = CountUpdates()
    longer.callbacks.append(counter)
    result = longer.train(resume_from_checkpoint=True)[A]
    assert counter.updates == 1 and result.status == "finished" and result.global_step == 3
    assert curves(result) == curves(straight.trials[A].state.log_history)
    assert max_abs_diff(longer.adapter_state_dict(A), straight.adapter_state_dict(A)) == 0.0


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


# Damage to one file of trial B's newest checkpoint (checkpoint-4). Forged files come with a forged manifest
# (``reseal``: valid hashes), so the checks behind the hashes are reached too. (damage, words of the refusal)
def _truncate(folder):
    f = folder / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    return f, "bytes instead of"


def _garbage_safetensors(folder):
    f = folder / "adapter_model.safetensors"
    f.write_bytes(b"\x00" * f.stat().st_size)
    return f, "does not match its SHA-256"


def _garbage_safetensors_resealed(folder):
    f = folder / "adapter_model.safetensors"
    f.write_bytes(b"\x00" * f.stat().st_size)
    reseal(folder)
    return f, "cannot be read as safetensors"


def _hostile_pickle(folder):
    f = folder / "optimizer.pt"
    f.write_bytes(pickle.dumps(_Evil()))
    reseal(folder)
    return f, "optimizer.pt cannot be read"


def _nan_adapter(folder):
    from safetensors.torch import load_file, save_file

    f = folder / "adapter_model.safetensors"
    state = load_file(str(f))
    name = sorted(state)[1]
    state[name][0, 0] = float("nan")
    save_file(state, str(f))
    reseal(folder)
    return f, f"NaN or infinite values in the LoRA adapter: tensor {name}"


def _nan_optimizer_moment(folder):
    f = folder / "optimizer.pt"
    state = torch.load(f, weights_only=True)
    state["state"][2]["exp_avg_sq"].view(-1)[0] = float("inf")
    torch.save(state, f)
    reseal(folder)
    return f, "NaN or infinite values in the optimizer state: tensor state/2/exp_avg_sq"


def _bad_state(folder):
    f = folder / "trainer_state.json"
    f.write_text("{" + " " * (f.stat().st_size - 1))
    return f, "does not match its SHA-256"


def _wrong_step(folder):
    f = folder / "trainer_state.json"
    f.write_text(f.read_text().replace('"global_step": 4', '"global_step": 7'))
    reseal(folder)
    return f, "global_step 7 is not the update checkpoint-4 was saved at"


def _trial_json_of_another_trial(folder):
    f = folder / "trial.json"
    f.write_text(f.read_text().replace(B, A))
    reseal(folder)
    return f, "cannot be read as the trial's description"


def _missing_file(folder):
    f = folder / "scheduler.pt"
    f.unlink()
    return f, "is missing"


def _manifest_garbage(folder):
    f = folder / MANIFEST
    f.write_text("[]")
    return f, "is not a checkpoint manifest"


def _manifest_deleted(folder):
    f = folder / MANIFEST
    f.unlink()
    return None, None  # an unfinished save: skipped (with a warning), checkpoint-3 used


TRIAL_DAMAGE = [_truncate, _garbage_safetensors, _garbage_safetensors_resealed, _hostile_pickle, _nan_adapter,
                _nan_optimizer_moment, _bad_state, _wrong_step, _trial_json_of_another_trial, _missing_file,
                _manifest_garbage, _manifest_deleted]  # fmt: skip


@pytest.fixture(scope="module")
def saved_sweep(tokenizer, tmp_path_factory):
    """A finished crash sweep's folder (checkpoints of updates 1-4, the clone from 2)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("saved")
    crash_sweep(tokenizer, out).train()
    return out


def _copy(saved_sweep, tmp_path) -> Path:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(saved_sweep, out)
    return out


@pytest.mark.parametrize("damage", TRIAL_DAMAGE, ids=[d.__name__.strip("_") for d in TRIAL_DAMAGE])
@pytest.mark.usefixtures("single_thread")
def test_a_damaged_checkpoint_falls_back_to_the_trials_previous_one(
    tokenizer, tmp_path, saved_sweep, damage, caplog
):
    """B's checkpoint-4 is refused by name; B redoes update 4 from checkpoint-3 and ends bit-exactly where
    the undamaged sweep ended; A and the clone (finished) run nothing."""
    import logging

    from safetensors.torch import load_file

    out = _copy(saved_sweep, tmp_path)
    path, message = damage(out / "trials" / B / "checkpoint-4")
    sweep = crash_sweep(tokenizer, out)
    with caplog.at_level(logging.WARNING):
        sweep.train(resume_from_checkpoint=True)
    if path is not None:
        lines = [r.getMessage() for r in caplog.records if "resumes from checkpoint-3" in r.getMessage()]
        assert len(lines) == 1 and str(path) in lines[0] and message in lines[0], caplog.text
    assert _updates(sweep) == 1  # B's update 4, nothing else
    expected = load_file(str(saved_sweep / "trials" / B / "checkpoint-4" / "adapter_model.safetensors"))
    assert max_abs_diff(sweep.adapter_state_dict(B), expected) == 0.0
    assert all(t.status == "finished" for t in sweep.trials.values())


def test_a_trial_without_a_good_checkpoint_is_marked_and_the_others_resume(
    tokenizer, tmp_path, saved_sweep, caplog
):
    """Every checkpoint of B damaged (NaN in its newest, the older ones gone): B is marked ``damaged`` with
    the file and the tensor named, in the index and summary.json; A and the clone resume."""
    import logging
    import shutil

    out = _copy(saved_sweep, tmp_path)
    for n in (1, 2, 3):
        shutil.rmtree(out / "trials" / B / f"checkpoint-{n}")
    path, message = _nan_adapter(out / "trials" / B / "checkpoint-4")
    sweep = crash_sweep(tokenizer, out, max_steps=5)
    with caplog.at_level(logging.WARNING):
        results = sweep.train(resume_from_checkpoint=True)
    assert results[B].status == "damaged" and str(path) in sweep.trials[B].reason
    assert message in sweep.trials[B].reason
    assert results[A].status == results[CLONE].status == "finished" and results[A].global_step == 5
    assert _updates(sweep) == 2  # A's and the clone's update 5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"][B]["state"] == "damaged" and str(path) in summary["trials"][B]["reason"]
    assert json.loads((out / INDEX).read_text())["trials"][B]["status"] == "damaged"
    assert f"trial {B} is marked damaged" in caplog.text


def test_a_clone_whose_folder_vanished_is_marked_and_the_others_resume(tokenizer, tmp_path, saved_sweep):
    import shutil

    out = _copy(saved_sweep, tmp_path)
    shutil.rmtree(out / "trials" / CLONE)
    sweep = crash_sweep(tokenizer, out, max_steps=5)
    results = sweep.train(resume_from_checkpoint=True)
    assert results[CLONE].status == "damaged" and "holds no complete checkpoint" in sweep.trials[CLONE].reason
    assert results[A].global_step == results[B].global_step == 5


def _misspelt_status(out):
    f = out / INDEX
    index = json.loads(f.read_text())
    index["trials"][B]["status"] = "runing"
    f.write_text(json.dumps(index))
    return f, "status 'runing' is none of"


def _index_not_json(out):
    f = out / INDEX
    f.write_bytes(b"\xff{")
    return f, INDEX


def _index_bad_name(out):
    f = out / INDEX
    index = json.loads(f.read_text())
    index["trials"]["../../etc"] = index["trials"][B]
    f.write_text(json.dumps(index))
    return f, "is not allowed"


def _wrong_value_head(out):
    folder = out / "trials" / B / "checkpoint-4"
    f = folder / "value_head.pt"
    torch.save({"summary.weight": torch.zeros(1, 3)}, f)
    reseal(folder)
    return f, "does not fit this run's value head"


SWEEP_DAMAGE = [_misspelt_status, _index_not_json, _index_bad_name, _wrong_value_head]


@pytest.mark.parametrize("damage", SWEEP_DAMAGE, ids=[d.__name__.strip("_") for d in SWEEP_DAMAGE])
def test_a_damaged_index_or_a_forged_checkpoint_refuses_the_resume(tokenizer, tmp_path, saved_sweep, damage):
    out = _copy(saved_sweep, tmp_path)
    path, message = damage(out)
    sweep = crash_sweep(tokenizer, out, max_steps=5)
    before = _snapshot(sweep)
    with pytest.raises(SweepCheckpointError) as err:
        sweep.train(resume_from_checkpoint=True)
    text = str(err.value)
    assert str(path) in text and message in text and "\n" not in text
    _same(_snapshot(sweep), before)  # nothing restored, no clone added
    assert _updates(sweep) == 0


def test_changed_overrides_are_refused(tokenizer, tmp_path, saved_sweep):
    out = _copy(saved_sweep, tmp_path)
    sweep = make_sweep(tokenizer, out, {A: {"kl_coef": 0.3}, B: TRIALS[B]}, max_steps=4)
    with pytest.raises(SweepCheckpointError, match=r"kl_coef: saved 0.01, this run 0.3"):
        sweep.train(resume_from_checkpoint=True)
    other_seed = make_sweep(tokenizer, out, {A: TRIALS[A], B: TRIALS[B]}, max_steps=4, seed=3)
    with pytest.raises(SweepCheckpointError, match=r"seed saved 0, this run 3"):
        other_seed.train(resume_from_checkpoint=True)


@pytest.mark.usefixtures("single_thread")
def test_checkpoints_of_an_earlier_sweep_in_the_folder_are_never_resumed(tokenizer, tmp_path, caplog):
    import logging

    make_sweep(tokenizer, tmp_path, {A: TRIALS[A]}, save_strategy="steps", save_steps=1).train()  # 1..3
    fresh = dict(seed=7, lr_scheduler_type="constant")
    make_sweep(tokenizer, tmp_path, {A: TRIALS[A]}, max_steps=1, **fresh).train()  # a new sweep, same folder
    straight = make_sweep(tokenizer, tmp_path / "straight", {A: TRIALS[A]}, max_steps=2, **fresh)
    straight.train()
    resumed = make_sweep(tokenizer, tmp_path, {A: TRIALS[A]}, max_steps=2, **fresh)
    counter = CountUpdates()
    resumed.callbacks.append(counter)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert "checkpoint-3: an earlier sweep in this output folder wrote it" in caplog.text
    assert counter.updates == 1  # from this sweep's checkpoint-1, not the earlier sweep's checkpoint-3
    assert max_abs_diff(resumed.adapter_state_dict(A), straight.adapter_state_dict(A)) == 0.0
