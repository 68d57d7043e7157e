"""Prompts and model builders shared by the rollout tests."""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["task: abc ->", "task: zq ->", "hello there, world ->", "x", "task: mnopq ->"]


@pytest.fixture()
def prompts(tokenizer):
    """Left-padded mixed-length prompts: ``(input_ids [5, P], attention_mask [5, P])``, P not a multiple of 32."""
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: these tiny models are ~10x faster that way on the shared 2-core machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
