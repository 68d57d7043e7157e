"""load_config: every source spelling, RAPIDFIRE_* environment overrides, and file/preset errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rapidfire_hf.config import (
    PRESETS,
    ConfigError,
    FallbackRule,
    RapidFireConfig,
    env_variables,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
ADVANCED = REPO / "config" / "advanced.yaml"


@pytest.fixture(autouse=True)
def clean_env(no_rapidfire_env):
    """Tests start without RAPIDFIRE_* variables from the calling shell."""


def test_advanced_yaml_values():
    cfg = load_config(str(ADVANCED))
    g, m, p = cfg.gradient, cfg.memory, cfg.precision
    assert g.pipeline is True and g.pipeline_depth == 8 and g.overlap_factor == 0.7 and g.sync_interval >= 1
    assert m.optimization in ("balanced", "aggressive")
    assert m.compaction_threshold == 0.4 and m.prefetch_window == 3
    assert p.mode == "adaptive" and p.initial == "bf16"
    assert p.fallback == [
        FallbackRule(condition="grad_norm > 1.0", action="switch_to fp32"),
        FallbackRule(condition="throughput < 100", action="disable_pipeline"),
    ]
    assert (p.fallback[0].metric, p.fallback[0].op, p.fallback[0].threshold) == ("grad_norm", ">", 1.0)
    assert (p.fallback[1].verb, p.fallback[1].argument) == ("disable_pipeline", None)
    assert cfg.logging.log_every >= 1


def test_advanced_yaml_comments_every_key():
    lines = ADVANCED.read_text().splitlines()
    for index, line in enumerate(lines):
        match = re.match(r"^\s*(?:- )?(\w+):", line)
        # a rule's `action` sits right under its `condition`, which carries the rule's comment
        if match and match[1] != "action":
            assert lines[index - 1].strip().startswith("#"), f"no comment above line {index + 1}: {line!r}"


def test_none_gives_balanced_defaults_and_path_object_works():
    assert load_config() == PRESETS["balanced"] == RapidFireConfig()
    assert load_config(ADVANCED) == load_config(str(ADVANCED))


def test_short_form():
    cfg = load_config(
        {"gradient_pipeline": True, "memory_optimization": "aggressive", "precision": "adaptive"}
    )
    assert (
        cfg.gradient.pipeline is True
        and cfg.memory.optimization == "aggressive"
        and cfg.precision.mode == "adaptive"
    )
    # the rest stays balanced
    assert cfg.gradient.pipeline_depth == PRESETS["balanced"].gradient.pipeline_depth
    off = load_config({"gradient_pipeline": False, "precision": "fp32"})
    assert off.gradient.pipeline is False and (off.precision.mode, off.precision.initial) == (
        "static",
        "fp32",
    )


def test_preset_key_is_the_base_for_overrides():
    cfg = load_config(
        {"preset": "aggressive", "gradient": {"pipeline_depth": 2}, "memory_optimization": "balanced"}
    )
    aggressive = PRESETS["aggressive"]
    assert cfg.gradient.pipeline_depth == 2 and cfg.memory.optimization == "balanced"
    assert cfg.gradient.overlap_factor == aggressive.gradient.overlap_factor
    assert cfg.precision.fallback == aggressive.precision.fallback


def test_config_instance_is_copied_and_revalidated():
    original = PRESETS["conservative"]
    cfg = load_config(original)
    assert cfg == original and cfg is not original
    original.gradient.pipeline_depth = 0  # invalid after construction: load_config checks again
    with pytest.raises(ConfigError, match="gradient.pipeline_depth"):
        load_config(original)


def test_env_overrides_beat_the_file(monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", "4")
    monkeypatch.setenv("RAPIDFIRE_MEMORY_OPTIMIZATION", "conservative")
    monkeypatch.setenv("RAPIDFIRE_PRECISION_INITIAL", "fp16")
    monkeypatch.setenv("RAPIDFIRE_GRADIENT_PIPELINE", "off")
    monkeypatch.setenv("RAPIDFIRE_LOGGING_REPORT_TO", "wandb, tensorboard")
    monkeypatch.setenv(
        "RAPIDFIRE_PRECISION_FALLBACK", "loss > 5 -> compact_memory; approx_kl > 0.1 -> switch_to fp32"
    )
    cfg = load_config(ADVANCED)
    assert cfg.gradient.pipeline_depth == 4 and cfg.gradient.pipeline is False
    assert cfg.memory.optimization == "conservative" and cfg.precision.initial == "fp16"
    assert cfg.logging.report_to == ["wandb", "tensorboard"]
    assert [r.to_dict() for r in cfg.precision.fallback] == [
        {"condition": "loss > 5", "action": "compact_memory"},
        {"condition": "approx_kl > 0.1", "action": "switch_to fp32"},
    ]
    assert cfg.gradient.overlap_factor == 0.7  # untouched keys keep the file's values
    assert load_config(ADVANCED, env=False).gradient.pipeline_depth == 8


def test_env_applies_to_presets_and_dicts(monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_MEMORY_COMPACTION_THRESHOLD", "0.9")
    assert load_config("aggressive").memory.compaction_threshold == 0.9
    assert load_config({"precision": "fp32"}).memory.compaction_threshold == 0.9


@pytest.mark.parametrize(
    "name, text, key, allowed",
    [
        ("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", "eight", "gradient.pipeline_depth", "an integer >= 1"),
        ("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", "0", "gradient.pipeline_depth", "an integer >= 1"),
        (
            "RAPIDFIRE_MEMORY_OPTIMIZATION",
            "max",
            "memory.optimization",
            "'conservative', 'balanced', 'aggressive'",
        ),
        ("RAPIDFIRE_GRADIENT_PIPELINE", "maybe", "gradient.pipeline", "true or false"),
        (
            "RAPIDFIRE_PRECISION_FALLBACK",
            "loss >> 5 -> compact_memory",
            "precision.fallback[0].condition",
            "<op>",
        ),
    ],
)
def test_bad_env_value_names_variable_key_value_allowed(monkeypatch, name, text, key, allowed):
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError) as info:
        load_config(ADVANCED)
    message = str(info.value)
    assert message.startswith(f"environment variable {name}: {key}:"), message
    assert allowed in message


def test_unknown_env_variable_suggests_closest(monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_GRADIENT_PIPELINEDEPTH", "4")
    with pytest.raises(ConfigError, match="did you mean RAPIDFIRE_GRADIENT_PIPELINE_DEPTH"):
        load_config()
    monkeypatch.delenv("RAPIDFIRE_GRADIENT_PIPELINEDEPTH")
    monkeypatch.setenv("RAPIDFIRE_SOMETHING_ELSE", "x")  # outside the config prefixes: ignored
    assert load_config() == RapidFireConfig()


def test_env_variable_names_cover_every_field():
    names = env_variables()
    assert names["RAPIDFIRE_GRADIENT_PIPELINE_DEPTH"] == ("gradient", "pipeline_depth")
    assert names["RAPIDFIRE_PRECISION_INITIAL"] == ("precision", "initial")
    assert len(names) == sum(len(section) for section in RapidFireConfig().to_dict().values())


def test_missing_file():
    with pytest.raises(ConfigError) as info:
        load_config("configs/nope.yaml")
    message = str(info.value)
    assert "config file not found" in message and "'configs/nope.yaml'" in message and "'balanced'" in message


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("gradient:\n  pipeline_depth: [8\nmemory: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: invalid YAML") and "line" in message


def test_file_must_hold_a_mapping_and_empty_file_is_defaults(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- gradient\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping; got \['gradient'\]"):
        load_config(path)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(empty) == RapidFireConfig()


def test_error_in_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gradient:\n  pipeline_depth: eight\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: gradient.pipeline_depth: invalid value; got 'eight' (str)")
    assert info.value.source == str(path) and info.value.key == "gradient.pipeline_depth"


def test_unknown_preset_suggests_closest():
    with pytest.raises(ConfigError) as info:
        load_config("agressive")
    message = str(info.value)
    assert "unknown preset (did you mean 'aggressive'?)" in message and "'agressive'" in message
    assert "'conservative', 'balanced', 'aggressive'" in message
    with pytest.raises(ConfigError, match=r"^preset: unknown preset"):
        load_config({"preset": "fast"})


@pytest.mark.parametrize(
    "data, key, allowed",
    [
        ({"gradient_pipeline": "yes"}, "gradient_pipeline", "true or false"),
        ({"memory_optimization": "max"}, "memory_optimization", "'aggressive'"),
        ({"precision": "fp8"}, "precision", "'adaptive', 'bf16'"),
        ({"gradient_pipline": True}, "gradient_pipline", "gradient_pipeline"),
    ],
)
def test_short_form_errors(data, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.key == key and allowed in str(info.value)


def test_unsupported_source_type():
    with pytest.raises(ConfigError, match="unsupported config source; got 42"):
        load_config(42)


@pytest.mark.parametrize("name", ["x" * 300, "x" * 300 + ".yaml", "config/" + "y" * 300, "config/" + "y" * 300 + ".yml"])
def test_a_name_over_the_file_systems_limit_is_a_config_error(name):
    with pytest.raises(ConfigError) as err:
        load_config(name)
    assert "File name too long" in str(err.value) or "unknown preset" in str(err.value)
