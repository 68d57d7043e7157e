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


def test_a_config_files_sync_interval_is_capped_and_said_once(build, capsys, tmp_path):
    # config/advanced.yaml (README's enable_rapidfire example) lists every key, sync_interval 2 among them
    from pathlib import Path

    from rapidfire_hf.integrations.optimizer import find_rapidfire_optimizer

    advanced = Path(__file__).resolve().parents[2] / "config" / "advanced.yaml"
    trainer = build("sft", max_steps=1)
    enable_rapidfire(trainer, config=str(advanced))
    out = capsys.readouterr().out
    assert out.count("gradient.sync_interval=2 runs as 1") == 1
    trainer.create_optimizer()
    assert find_rapidfire_optimizer(trainer.optimizer).sync_interval == 1  # what the table says is what runs
    own = tmp_path / "mine.yaml"
    own.write_text("gradient:\n  sync_interval: 1\n")
    enable_rapidfire(build("sft", max_steps=1), config=str(own))
    assert "sync_interval" not in capsys.readouterr().out  # nothing capped, nothing said
