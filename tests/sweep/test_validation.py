"""Every key of a sweep is checked before anything loads: trial names, types and values, LoRA settings,
reward functions, stopping rules, duplicate YAML keys; and the per-trial field table agrees with PPOConfig."""

from __future__ import annotations

import dataclasses

import pytest

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.ppo import PPOConfig
from rapidfire_hf.sweep.fields import FIELD_KINDS, NAME_LIMIT, PER_TRIAL_FIELDS, value_problem
from rapidfire_hf.sweep.spec import load_spec, validate
from rapidfire_hf.sweep.trial import trial_args

BASE = {"reward_funcs": ["demo"], "trials": {"a": {"kl_coef": 0.1}}}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"trials": {"n" * 300: {}}}, r"trials: trial name n{40}\.\.\. is 300 characters long: at most 128"),
        ({"trials": {"a/b": {}}}, r"trials: trial name 'a/b' is not allowed"),
        ({"trials": {"..": {}}}, r"trials: trial name '\.\.' is not allowed"),
        ({"trials": {1: {}}}, r"trials: trial name 1 must be a string \(in YAML, quote it: '1'\)"),
        ({"trials": {"a": {"kl_coef": "lots"}}}, r"trials.a: trial 'a': kl_coef takes a finite number"),
        (
            {"trials": {"a": {"lr_scheduler_kwargs": "oops"}}},
            r"trials.a: .*lr_scheduler_kwargs takes a mapping",
        ),
        ({"trials": {"a": {"lr_scheduler_type": "bogus"}}}, r"trials.a: trial 'a': .*bogus"),
        ({"trials": {"a": {"kl_estimator": "k9"}}}, r"trials.a: trial 'a': .*k9"),
        ({"trials": {"a": {"warmup_ratio": 0.1}}}, r"trials.a.warmup_ratio: unknown key"),
        ({"trials": {"a": [1]}}, r"trials.a: must be a mapping"),
        ({"config": {"per_device_train_batch_size": "eight"}}, r"config: PPOConfig refuses it"),
        ({"config": [1]}, r"config: must be a mapping"),
        ({"lora": "garbage"}, r"lora: must be a mapping"),
        ({"lora": {"rank": 8}}, r"lora: peft's LoraConfig refuses it"),
        ({"lora": {"r": 0}}, r"lora"),
        ({"reward_funcs": [42]}, r"reward_funcs: must be 'demo', 'package.module:function'"),
        ({"reward_funcs": []}, r"reward_funcs: must be"),
        ({"model": 3}, r"model: must be a string"),
        (
            {"early_stopping": {"margin": "lots"}},
            r"early_stopping: EarlyStopping margin must be a finite number",
        ),
        ({"early_stopping": "yes"}, r"early_stopping: must be a mapping"),
        (
            {"successive_halving": {"keep": 2}},
            r"successive_halving: SuccessiveHalving keep must be a fraction",
        ),
        ({"successive_halving": {"rungs": [4, 2]}}, r"successive_halving: .*increasing update counts"),
        ({"successive_halving": {"eta": 3}}, r"successive_halving.eta: unknown key"),
    ],
)
def test_every_key_and_value_is_checked(edit, message):
    with pytest.raises(ConfigError, match=message):
        validate({**BASE, **edit})


def test_good_spec_passes_with_both_rules():
    spec = validate({**BASE, "early_stopping": {"margin": 0.2}, "successive_halving": {"rungs": [2, 4]}})
    assert spec["model"] == "demo"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "reward_funcs: [demo]\ntrials:\n  a: {kl_coef: 0.1}\n  a: {kl_coef: 0.2}\n",
            r"a: is given twice \(line 4\)",
        ),
        (
            "reward_funcs: [demo]\nreward_funcs: [demo]\ntrials: {a: {}}\n",
            r"reward_funcs: is given twice \(line 2\)",
        ),
        ("reward_funcs: [demo]\ntrials: {a: {kl_coef: 0.1, kl_coef: 0.2}}\n", r"kl_coef: is given twice"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("a: [\n", "invalid YAML"),
    ],
)
def test_yaml_file_problems_name_the_file(tmp_path, text, message):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_spec(spec)
    assert "sweep.yaml" in str(err.value)


def test_per_trial_fields_are_what_ppo_config_accepts():
    fields = {f.name: f for f in dataclasses.fields(PPOConfig) if f.init}
    assert PER_TRIAL_FIELDS <= set(fields), PER_TRIAL_FIELDS - set(fields)
    for key in PER_TRIAL_FIELDS:  # each field's default is a value of the kind the table says
        assert value_problem(key, fields[key].default) is None, key
    shared = PPOConfig(output_dir="x", report_to=[])
    for key, kind in FIELD_KINDS.items():  # and PPOConfig accepts a value of that kind
        value = {"float": 0.5, "int": 2, "bool": True, "str": None, "dict?": {}, "int?": 64, "float?": 1.0,
                 "floats?": [1.0]}[kind]  # fmt: skip
        if value is not None:
            trial_args(shared, {key: value}, "t")


def test_trial_args_refuse_what_would_fail_later():
    shared = PPOConfig(output_dir="x", report_to=[])
    with pytest.raises(ValueError, match="trial 't': lr_scheduler_kwargs takes a mapping"):
        trial_args(shared, {"lr_scheduler_kwargs": "oops"}, "t")
    with pytest.raises(ValueError, match="trial 't': .*unexpected keyword argument 'nope'"):
        trial_args(shared, {"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"nope": 1}}, "t")
    with pytest.raises(ValueError, match="overrides must be a mapping"):
        trial_args(shared, [1], "t")


class _NoModel:
    """A model that must not be touched: the sweep checks its trials first."""

    def __getattr__(self, name):
        raise AssertionError(f"the model was used ({name}) before the trials were checked")


@pytest.mark.parametrize(
    ("trials", "message"),
    [
        ({"n" * (NAME_LIMIT + 1): {}}, "characters long"),
        ({"a b": {}}, "is not allowed"),
        ({"a": {"kl_coef": "lots"}}, "kl_coef takes a finite number"),
        ({"a": {"lr_scheduler_kwargs": "oops"}}, "lr_scheduler_kwargs takes a mapping"),
        ({"a": {"temperature": 0.5}}, "'temperature' is shared by every trial"),
    ],
)
def test_ppo_sweep_checks_trials_before_the_model(tokenizer, tmp_path, trials, message):
    from rapidfire_hf.demo import make_prompt_dataset, vowel_reward
    from rapidfire_hf.sweep import PPOSweep

    from .helpers import lora_config

    with pytest.raises(ValueError, match=message):
        PPOSweep(
            args=PPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True),
            trials=trials,
            model=_NoModel(),
            processing_class=tokenizer,
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(8),
            peft_config=lora_config(),
        )


def test_the_docs_sweep_file_is_valid_and_is_the_example_that_learns():
    import re
    from pathlib import Path

    import yaml

    from rapidfire_hf.sweep.spec import validate

    root = Path(__file__).resolve().parents[2]
    block = re.search(r"```yaml\n(.*?)```", (root / "docs" / "sweep.md").read_text(), re.S).group(1)
    doc = yaml.safe_load(block)
    validate(doc)
    example = yaml.safe_load((root / "examples" / "sweep.yaml").read_text())
    # the documented file is examples/sweep.yaml (whose trials are shown to separate by a test) plus
    # successive halving; its trials and shared settings may not drift back to rates that learn nothing
    assert doc["trials"] == example["trials"] and doc["config"] == example["config"]
    assert doc["lora"] == example["lora"]
