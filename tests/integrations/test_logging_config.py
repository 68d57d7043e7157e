"""logging.log_every and logging.level act: rapidfire/* metrics every N steps (transformers trainer and
PPOTrainer), and the rapidfire_hf logger's level."""

from __future__ import annotations

import logging

import pytest
from rf_trainers import PARITY_CONFIG

from rapidfire_hf.integrations import enable_rapidfire
from rapidfire_hf.utils.logs import LogCadence, set_log_level


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


@pytest.fixture()
def library_level():
    logger = logging.getLogger("rapidfire_hf")
    before = logger.level
    yield logger
    logger.setLevel(before)


def steps_with_rapidfire(history):
    return [h["step"] for h in history if "loss" in h and any(k.startswith("rapidfire/") for k in h)]


def test_cadence():
    cadence = LogCadence(3)
    assert [s for s in range(1, 11) if cadence.due(s)] == [3, 6, 9]
    every_log = LogCadence(1)
    assert [s for s in (2, 4, 6) if every_log.due(s)] == [2, 4, 6]
    with pytest.raises(ValueError, match="log_every=0"):
        LogCadence(0)


@pytest.mark.parametrize(("every", "expected"), [(1, [1, 2, 3, 4]), (2, [2, 4]), (3, [3])])
def test_log_every_in_a_transformers_trainer(build, every, expected):
    trainer = enable_rapidfire(build("sft"), config={**PARITY_CONFIG, "logging": {"log_every": every}})
    trainer.train()
    assert steps_with_rapidfire(trainer.state.log_history) == expected
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 4  # the trainer's own logs stay


def test_log_every_in_ppo(tmp_path, tokenizer):
    from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOTrainer
    from tests.ppo.helpers import ppo_args

    args = ppo_args(tmp_path, max_steps=4, num_ppo_epochs=1, rapidfire_config={"logging": {"log_every": 2}})
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        value_model=build_tiny_value_model(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    assert [h["step"] for h in logs if "rapidfire/oom_splits" in h] == [2, 4]


def test_level_sets_the_library_logger(build, library_level, caplog):
    enable_rapidfire(build("sft"), config={**PARITY_CONFIG, "logging": {"level": "error"}})
    assert library_level.level == logging.ERROR
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("rapidfire_hf.memory").warning("dropped")
        set_log_level("debug")
        logging.getLogger("rapidfire_hf.memory").debug("kept")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("rapidfire_hf")] == ["kept"]
