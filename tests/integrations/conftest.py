"""Fixtures of the integration tests: tiny TRL trainers built on CPU (see rf_trainers.py)."""

from __future__ import annotations

import pytest
from rf_trainers import BUILDERS


@pytest.fixture()
def build(tokenizer, tmp_path, tiny_model_dir):
    """``build(kind, **training_args)`` -> a fresh tiny trainer of that kind."""

    def _build(kind, **overrides):
        if kind == "rloo":
            overrides["model_dir"] = tiny_model_dir
        return BUILDERS[kind](tokenizer, tmp_path, **overrides)

    return _build
