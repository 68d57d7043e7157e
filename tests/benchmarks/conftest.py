"""Fixtures of the benchmark smoke tests: each test's telemetry and process registry in its own folder, and
accelerate's process-wide state reset after each test (the scripts build Accelerators and Trainers)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAPIDFIRE_TELEMETRY_DIR", raising=False)
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
