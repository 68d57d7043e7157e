"""Fixtures of the optimizer tests: accelerate's process-wide state is reset after each test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # An Accelerator (or a Trainer) leaves GradientState initialised, and the pipeline reads its
    # sync_gradients flag: a later plain-loop test must not inherit it.
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
