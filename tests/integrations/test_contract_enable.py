"""enable_rapidfire on a transformers/TRL trainer: config settings it does not apply are refused by name
before anything is installed; what it cannot change (the trainer's autocast) is said in its start table."""

from __future__ import annotations

import pytest

from rapidfire_hf import enable_rapidfire
from rapidfire_hf.config.errors import ConfigError


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"gradient": {"sync_interval": 4}}, "gradient.sync_interval"),
        ({"gradient": {"clip_prediction": "scale"}}, "gradient.clip_prediction"),
        ({"memory": {"planner": False}}, "memory.planner"),
    ],
)
def test_refused_config_fields_name_the_key_and_install_nothing(build, config, key):
    trainer = build("sft", max_steps=1)
    with pytest.raises(ConfigError) as info:
        enable_rapidfire(trainer, config=config)
    assert info.value.key == key
    assert not hasattr(trainer, "_rapidfire")


def test_clip_prediction_asked_through_optimizer_kwargs_is_applied(build):
    trainer = build("sft", max_steps=1)
    enable_rapidfire(trainer, config={"gradient": {"clip_prediction": "scale"}},
                     optimizer_kwargs={"clip_prediction": "scale"})  # fmt: skip
    trainer.create_optimizer()
    from rapidfire_hf.integrations.optimizer import find_rapidfire_optimizer

    assert find_rapidfire_optimizer(trainer.optimizer).clip_prediction == "scale"


def test_a_precision_the_trainer_does_not_compute_in_is_said_in_the_start_table(build, capsys):
    trainer = build("sft", max_steps=1)
    enable_rapidfire(trainer, config={"precision": {"mode": "static", "initial": "fp16"}})
    out = capsys.readouterr().out
    assert "precision.initial=fp16 (the trainer computes in" in out
