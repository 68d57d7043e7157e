"""Presets: each is valid, they differ where documented, and config/<preset>.yaml matches each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rapidfire_hf.config import PRESET_DESCRIPTIONS, PRESETS, RapidFireConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def test_preset_names_and_descriptions():
    assert list(PRESETS) == ["conservative", "balanced", "aggressive"]
    assert set(PRESET_DESCRIPTIONS) == set(PRESETS)


def test_balanced_is_the_default():
    assert PRESETS["balanced"] == RapidFireConfig()


def test_presets_differ_meaningfully():
    con, bal, agg = (PRESETS[n] for n in ("conservative", "balanced", "aggressive"))
    assert (con.gradient.pipeline, bal.gradient.pipeline, agg.gradient.pipeline) == (False, True, True)
    assert con.gradient.pipeline_depth < bal.gradient.pipeline_depth < agg.gradient.pipeline_depth
    assert [c.memory.optimization for c in (con, bal, agg)] == ["conservative", "balanced", "aggressive"]
    # lower threshold = compaction sooner
    assert con.memory.compaction_threshold > bal.memory.compaction_threshold > agg.memory.compaction_threshold
    assert (con.precision.mode, bal.precision.mode, agg.precision.mode) == ("static", "adaptive", "adaptive")
    assert con.precision.fallback == [] and len(agg.precision.fallback) > len(bal.precision.fallback)


def test_lookup_returns_an_independent_copy():
    first = PRESETS["aggressive"]
    first.gradient.pipeline_depth = 1
    assert PRESETS["aggressive"].gradient.pipeline_depth == 16
    with pytest.raises(KeyError):
        PRESETS["fast"]


@pytest.mark.parametrize("name", ["conservative", "balanced", "aggressive"])
def test_preset_file_matches_preset(name, monkeypatch):
    for var in [v for v in os.environ if v.startswith("RAPIDFIRE_")]:
        monkeypatch.delenv(var)
    assert load_config(REPO / "config" / f"{name}.yaml") == PRESETS[name]
    assert load_config(name) == PRESETS[name]
