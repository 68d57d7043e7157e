"""Kernel tests run single-threaded (the CI machines have 2 shared cores)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here runs single-threaded (``single_thread`` in tests/conftest.py)."""
