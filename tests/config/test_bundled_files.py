"""The config files shipped inside the package (package data) are the repository's config/*.yaml, and
``load_config`` finds them by name from any working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidfire_hf.config import load_config
from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.config.loader import BUNDLED_DIR, bundled_config, bundled_names

REPO_CONFIG = Path(__file__).resolve().parents[2] / "config"


def test_shipped_copies_equal_the_repository_files():
    repo = sorted(p.name for p in REPO_CONFIG.glob("*.yaml"))
    assert repo == sorted(p.name for p in BUNDLED_DIR.glob("*.yaml")) and repo
    for name in repo:  # edit config/X.yaml, then: cp config/*.yaml src/rapidfire_hf/config/files/
        assert (BUNDLED_DIR / name).read_bytes() == (REPO_CONFIG / name).read_bytes(), name


@pytest.mark.parametrize("src", ["advanced", "advanced.yaml", "config/advanced.yaml"])
def test_shipped_file_resolves_from_any_directory(tmp_path, monkeypatch, src):
    monkeypatch.chdir(tmp_path)
    assert bundled_config(src) == BUNDLED_DIR / "advanced.yaml"
    cfg = load_config(src, env=False)
    assert cfg.to_dict() == load_config(REPO_CONFIG / "advanced.yaml", env=False).to_dict()
    assert "advanced" in bundled_names()


def test_an_existing_file_wins_and_unknown_names_still_fail(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "advanced.yaml").write_text("gradient:\n  pipeline: false\n")
    assert bundled_config("config/advanced.yaml") is None
    assert load_config("config/advanced.yaml", env=False).gradient.pipeline is False
    for src in ("config/nope.yaml", "other/advanced.yaml", "advancd"):
        with pytest.raises(ConfigError):
            load_config(src, env=False)
