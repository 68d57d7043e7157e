"""enable_rapidfire refuses what it cannot do safely, with errors that say why."""

from __future__ import annotations

import pytest
import torch
from rf_trainers import PARITY_CONFIG

from rapidfire_hf.config import ConfigError, RapidFireConfig
from rapidfire_hf.integrations import RapidFireIntegrationError, enable_rapidfire


def test_twice_is_an_error(build):
    trainer = enable_rapidfire(build("sft", max_steps=1))
    with pytest.raises(RapidFireIntegrationError, match="already called"):
        enable_rapidfire(trainer)


def test_after_training_started_is_an_error(build):
    trainer = build("sft", max_steps=1)
    trainer.train()
    with pytest.raises(RapidFireIntegrationError, match="already trained"):
        enable_rapidfire(trainer)


def test_stepped_user_optimizer_is_an_error(build):
    trainer = build("sft", max_steps=1)
    params = list(trainer.model.parameters())
    trainer.optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()  # state now exists: resuming from it silently is not what the user meant
    with pytest.raises(RapidFireIntegrationError, match="already trained"):
        enable_rapidfire(trainer)


def test_bad_config_key_names_it(build):
    trainer = build("sft", max_steps=1)
    with pytest.raises(ConfigError, match="pipeline_dept"):
        enable_rapidfire(trainer, config={"gradient": {"pipeline_dept": 4}})
    assert not hasattr(trainer, "_rapidfire")  # nothing was installed by the failed call
    enable_rapidfire(trainer, config=PARITY_CONFIG)  # and the trainer is still usable


def test_not_a_trainer():
    with pytest.raises(TypeError, match="transformers.Trainer"):
        enable_rapidfire(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "config",
    ["aggressive", {"gradient_pipeline": False}, RapidFireConfig(gradient={"pipeline": False})],
    ids=["preset", "short-dict", "dataclass"],
)
def test_config_spellings(build, config, tmp_path):
    trainer = enable_rapidfire(build("sft", max_steps=1), config=config)
    expected = config == "aggressive"  # the preset keeps the pipeline on; the other two turn it off
    assert trainer._rapidfire.pipeline is expected


def test_config_from_yaml_path(build, tmp_path):
    path = tmp_path / "rf.yaml"
    path.write_text("gradient:\n  pipeline: false\nmemory:\n  optimization: aggressive\n")
    trainer = enable_rapidfire(build("sft", max_steps=1), config=str(path))
    assert trainer._rapidfire.pipeline is False
    assert trainer._rapidfire.parts["memory"].optimization == "aggressive"
