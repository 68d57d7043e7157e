"""Keep every test's telemetry and process registry inside its own temporary folder."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAPIDFIRE_TELEMETRY_DIR", raising=False)
    return tmp_path / "cache"
