"""Shared fixtures: tiny models and tokenizers built in code and saved to local paths (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tokenizer():
    from rapidfire_hf.demo import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture()
def tiny_policy(tokenizer):
    from rapidfire_hf.demo import build_tiny_llama

    return build_tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama policy and its tokenizer saved with save_pretrained, to load through the real path."""
    from rapidfire_hf.demo import build_tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
