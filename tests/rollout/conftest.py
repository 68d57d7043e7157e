"""Prompts and model builders shared by the rollout tests."""

from __future__ import annotations

import pytest

PROMPTS = ["task: abc ->", "task: zq ->", "hello there, world ->", "x", "task: mnopq ->"]


@pytest.fixture()
def prompts(tokenizer):
    """Left-padded mixed-length prompts: ``(input_ids [5, P], attention_mask [5, P])``, P not a multiple of 32."""
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here runs single-threaded (``single_thread`` in tests/conftest.py)."""
