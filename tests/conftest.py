"""Shared fixtures: tiny models and tokenizers built in code and saved to local paths (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# without a GPU the project's Triton kernels run in Triton's interpreter (read when a kernel module is
# imported, so it is set before any test imports one)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture()
def single_thread():
    """One intra-op thread: tiny models are ~10x faster that way on the shared 2-core machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def no_rapidfire_env(monkeypatch):
    """No RAPIDFIRE_* variables from the calling shell (they override config values)."""
    for name in [n for n in os.environ if n.startswith("RAPIDFIRE_")]:
        monkeypatch.delenv(name)
