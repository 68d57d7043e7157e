"""The memory levels have one table (``memory/levels.py``): the config's names, the preset files and every
derived view (planner, compaction, selective checkpointing) agree with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rapidfire_hf.config import load_config
from rapidfire_hf.config.presets import PRESETS
from rapidfire_hf.config.schema import MemoryLevel
from rapidfire_hf.memory import callback, card_plan, checkpointing, planner
from rapidfire_hf.memory.levels import MEMORY_LEVELS, level_name

ROOT = Path(__file__).resolve().parents[2]
PRESET_FILES = sorted((ROOT / "config").glob("*.yaml")) + sorted(
    (ROOT / "src" / "rapidfire_hf" / "config" / "files").glob("*.yaml")
)


def test_the_config_names_exactly_the_table_levels():
    assert [m.value for m in MemoryLevel] == list(MEMORY_LEVELS)


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_preset_file_names_a_level_of_the_table(path):
    level = yaml.safe_load(path.read_text())["memory"]["optimization"]
    assert level in MEMORY_LEVELS, f"{path}: memory.optimization={level!r} is not in memory/levels.py"
    assert load_config(str(path), env=False).memory.optimization == level


def test_each_preset_names_a_level_of_the_table():
    assert PRESETS and all(level_name(PRESETS[name].memory.optimization) for name in PRESETS)


def test_every_derived_view_reads_the_table():
    """A level's numbers written again anywhere (and drifting) fails here."""
    for name, level in MEMORY_LEVELS.items():
        target = planner.level_target(MemoryLevel(name))  # the enum, turned into its name once
        assert (target.device_share, target.recompute, target.eight_bit_state) == (
            level.device_share,
            level.recompute,
            level.eight_bit_state,
        )
        assert callback.MIN_INTERVAL_STEPS[name] == level.compaction_interval
        assert checkpointing.RECOMPUTE_BELOW.get(name) == level.recompute_below
        assert planner.LEVEL_POLICY.get(name) == level.checkpoint_policy
    assert checkpointing.LEVELS == callback.LEVELS == tuple(MEMORY_LEVELS)
    policies = [lv.checkpoint_policy for lv in MEMORY_LEVELS.values() if lv.checkpoint_policy]
    assert card_plan.level_policies("aggressive") == tuple(policies) == planner.POLICIES
    assert card_plan.level_policies("conservative") == ("none",)
    cb = callback.MemoryCompactionCallback(
        optimization="aggressive", telemetry=False, expandable_segments=False
    )
    assert cb.min_interval_steps == MEMORY_LEVELS["aggressive"].compaction_interval


def test_an_unknown_level_is_refused_naming_the_table():
    with pytest.raises(ValueError, match="expected one of conservative, balanced, aggressive, auto"):
        level_name("turbo")
    with pytest.raises(ValueError, match="turbo"):
        planner.level_target("turbo")


def _preset_texts(name: str) -> list[tuple[str, str]]:
    """Where a preset's memory level is described in words: its description, the first line of each of
    its YAML files, its row of the table in ``config/presets.py``'s docstring."""
    import re

    from rapidfire_hf.config import presets

    texts = [("PRESET_DESCRIPTIONS", presets.PRESET_DESCRIPTIONS[name])]
    texts += [(str(p), p.read_text().splitlines()[0]) for p in PRESET_FILES if p.stem == name]
    row = re.search(rf"^{name} .*?(?=^\S)", presets.__doc__, flags=re.M | re.S)
    texts.append(("config/presets.py docstring", row.group(0)))
    return texts


@pytest.mark.parametrize("name", list(PRESETS))
def test_what_the_preset_texts_say_of_the_level_is_the_table(name):
    """A share of the device, 8-bit AdamW state or 'no recompute' written in a preset's words (its YAML
    files' first line included) agrees with the level's row of ``memory/levels.py``."""
    import re

    level = MEMORY_LEVELS[level_name(PRESETS[name].memory.optimization)]
    texts = _preset_texts(name)
    assert len(texts) == 4, f"{name}: expected a description, two YAML files and a docstring row: {texts}"
    shares = 0
    for where, text in texts:
        for share in re.findall(r"plan(?: within)? (\d+)%", " ".join(text.split())):
            shares += 1
            assert int(share) == round(level.device_share * 100), f"{where}: {share}% for {name}: {level}"
        if re.search(r"8[- ]bit", text):
            assert level.eight_bit_state, f"{where} says 8-bit state for {name}, the table does not: {level}"
        if "no recompute" in text:
            assert not level.recompute, f"{where} says no recompute for {name}, the table does: {level}"
    assert shares, f"{name}: no text states the level's share of the device (the check would check nothing)"
