"""What a sweep writes (summary.json, chart, per-trial metrics.csv / log history, peft-format adapters),
resuming from checkpoints, and the validation of trial overrides."""

from __future__ import annotations

import json
import shutil

import pytest

from .helpers import TRIALS, curves, make_sweep, max_abs_diff

A, B = "kl0.01", "kl0.2-lr3"


@pytest.mark.usefixtures("single_thread")
def test_outputs_and_resume(tokenizer, tmp_path):
    trials = {A: TRIALS[A], B: TRIALS[B]}
    first = make_sweep(tokenizer, tmp_path, trials, save_strategy="steps", save_steps=2)
    results = first.train()
    summary = json.loads((tmp_path / "summary.json").read_text())["trials"]
    assert summary[B]["overrides"] == TRIALS[B] and summary[B]["updates"] == 3
    assert summary[B]["state"] == "finished"
    assert summary[A]["reward_last"] == results[A].log_history[-1]["objective/scores"]
    assert summary[A]["kl_last"] == results[A].log_history[-1]["objective/kl"]
    assert (tmp_path / "sweep_curves.png").stat().st_size > 10_000
    trial_dir = tmp_path / "trials" / A
    assert (trial_dir / "metrics.csv").read_text().count("\n") == 4  # header + 3 updates
    assert json.loads((trial_dir / "log_history.json").read_text()) == results[A].log_history
    assert {p.name for p in trial_dir.glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-3"}
    assert (trial_dir / "checkpoint-3" / "adapter_config.json").is_file()

    # a crash after update 2: the last checkpoints are those of update 2
    for name in trials:
        shutil.rmtree(tmp_path / "trials" / name / "checkpoint-3")
    second = make_sweep(tokenizer, tmp_path, trials)
    resumed = second.train(resume_from_checkpoint=True)
    for name in trials:
        assert curves(resumed[name]) == curves(results[name])
        assert max_abs_diff(second.adapter_state_dict(name), first.adapter_state_dict(name)) == 0.0


def test_saved_adapter_loads_into_peft(tokenizer, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from rapidfire_hf.demo import build_tiny_llama

    sweep = make_sweep(tokenizer, tmp_path, {A: TRIALS[A]}, max_steps=1, save_strategy="steps", save_steps=1)
    sweep.train()
    folder = tmp_path / "trials" / A / "checkpoint-1"
    model = PeftModel.from_pretrained(build_tiny_llama(tokenizer), str(folder))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved) == 8
    assert max_abs_diff({k.replace(".default", ""): v for k, v in loaded.items()}, saved) == 0.0


def test_override_validation(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"'kl_coeff' is not a PPOConfig field \(did you mean kl_coef"):
        make_sweep(tokenizer, tmp_path, {"a": {"kl_coeff": 0.1}})
    with pytest.raises(ValueError, match="'response_length' is shared by every trial"):
        make_sweep(tokenizer, tmp_path, {"a": {"response_length": 4}})
    with pytest.raises(ValueError, match="trial name 'a/b' is not allowed"):
        make_sweep(tokenizer, tmp_path, {"a/b": {}})
    with pytest.raises(ValueError, match="Invalid PPOConfig"):
        make_sweep(tokenizer, tmp_path, {"a": {"kl_estimator": "k2"}})


def test_lora_is_required(tokenizer, tmp_path):
    from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOConfig
    from rapidfire_hf.sweep import PPOSweep

    with pytest.raises(ValueError, match="LoRA adapter: pass peft_config=LoraConfig"):
        PPOSweep(
            args=PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
            trials={"a": {}},
            model=build_tiny_llama(tokenizer),
            processing_class=tokenizer,
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(16),
        )


@pytest.mark.usefixtures("single_thread")
def test_each_trial_logs_to_tensorboard(tokenizer, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sweep = make_sweep(
        tokenizer, tmp_path, {A: TRIALS[A], B: TRIALS[B]}, max_steps=2, report_to=["tensorboard"]
    )
    results = sweep.train()
    for name in (A, B):
        events = EventAccumulator(str(tmp_path / "runs" / name))
        events.Reload()
        scores = [(e.step, e.value) for e in events.Scalars("objective/scores")]
        expected = [(h["step"], h["objective/scores"]) for h in results[name].log_history]
        assert [s for s, _ in scores] == [1, 2]
        assert [v for _, v in scores] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_unknown_tracker_is_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="report_to 'mlflow': a sweep logs each trial to tensorboard, wandb"):
        make_sweep(tokenizer, tmp_path, {A: {}}, report_to=["mlflow"])


@pytest.mark.usefixtures("single_thread")
def test_each_trial_is_a_wandb_run_grouped_by_sweep(tokenizer, tmp_path, monkeypatch):
    import sys
    import types

    runs = []

    class Run:
        def __init__(self, **kwargs):
            self.kwargs, self.logged, self.finished = kwargs, [], False
            runs.append(self)

        def log(self, data, step):
            self.logged.append((step, data["objective/scores"]))

        def finish(self):
            self.finished = True

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run(**kw)))
    out = tmp_path / "my-sweep"
    sweep = make_sweep(tokenizer, out, {A: TRIALS[A], B: TRIALS[B]}, max_steps=2, report_to=["wandb"])
    results = sweep.train()
    assert sorted(r.kwargs["name"] for r in runs) == sorted([A, B])
    assert {r.kwargs["group"] for r in runs} == {"my-sweep"} and all(r.finished for r in runs)
    for run in runs:
        name = run.kwargs["name"]
        assert run.logged == [(h["step"], h["objective/scores"]) for h in results[name].log_history]
        assert run.kwargs["config"]["kl_coef"] == TRIALS[name]["kl_coef"]


@pytest.mark.usefixtures("single_thread")
def test_progress_off_a_terminal_is_one_line_per_update(tokenizer, tmp_path, capsys):
    sweep = make_sweep(tokenizer, tmp_path, {A: TRIALS[A], B: TRIALS[B]}, max_steps=2)
    sweep.show_progress = True  # pytest's captured stdout is not a terminal
    sweep.train()
    out = capsys.readouterr().out.splitlines()
    lines = [x for x in out if x.startswith("PPOSweep:")]
    assert len(lines) == 2 and f"{A} 2/2" in lines[1] and f"{B} 1/2" in lines[0]
    # the log hears at once that the sweep started, before its first update
    assert out[0].startswith("PPOSweep started: 2 trials") and str(tmp_path) in out[0]
    from rapidfire_hf.cli.sweep import print_summary

    print_summary(sweep, 1.0)
    summary = capsys.readouterr().out.splitlines()
    # the summary is set apart from the progress lines by a blank line and its own header
    assert summary[0] == "" and summary[1].startswith("summary (") and summary[2].startswith(f"{A}: reward")


def test_yaml_rules_reach_the_sweep(tmp_path):
    from rapidfire_hf.sweep.control import EarlyStopping, SuccessiveHalving
    from rapidfire_hf.sweep.spec import build, validate

    spec = validate(
        {
            "reward_funcs": ["demo"],
            "config": {"output_dir": str(tmp_path), "use_cpu": True, "response_length": 4},
            "trials": {"a": {"kl_coef": 0.1}, "b": {}},
            "early_stopping": {"margin": 0.2},
            "successive_halving": {"rungs": [2, 4], "keep": 0.25},
        }
    )
    sweep = build(spec, progress=False)
    halving = sweep.rules[1]
    assert isinstance(sweep.rules[0], EarlyStopping) and sweep.rules[0].margin == 0.2
    assert isinstance(halving, SuccessiveHalving) and halving.rungs == (2, 4) and halving.keep == 0.25


@pytest.mark.usefixtures("single_thread")
def test_save_total_limit_keeps_the_newest_checkpoints(tokenizer, tmp_path):
    sweep = make_sweep(
        tokenizer, tmp_path, {A: TRIALS[A]}, save_strategy="steps", save_steps=1, save_total_limit=2
    )
    sweep.train()
    assert sorted(p.name for p in (tmp_path / "trials" / A).iterdir() if p.is_dir()) == [
        "checkpoint-2",
        "checkpoint-3",
    ]


def test_settings_a_sweep_does_not_use_are_refused_by_name(tokenizer, tmp_path):
    """Once a warning, now the settings contract (config/contract.py): refused by name before any work."""
    from rapidfire_hf.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        make_sweep(tokenizer, tmp_path, {A: {}}, optim="adafactor", save_strategy="epoch", push_to_hub=False)
    assert {e.key for e in info.value.errors} == {"optim", "save_strategy"}  # push_to_hub=False: not used
    assert "every sweep trial trains with torch AdamW" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_sweep(tokenizer, tmp_path / "b", {A: {}}, rollout_generation_batch_size=4, rapidfire_config="balanced")
    assert info.value.key == "rollout_generation_batch_size"  # a preset name sets nothing by name: accepted
