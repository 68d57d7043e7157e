"""Kernel tests run single-threaded (the CI machines have 2 shared cores)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: these tiny models are ~10x faster that way on the shared 2-core machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
