"""Bad rapidfire config input refused with a bounded message naming the key, the value and the range.

Covers the upper bounds of the integer knobs, the environment (empty rule lists, wrong-case names) and
YAML documents whose aliases expand enormously.
"""

from __future__ import annotations

import math
import warnings

import pytest

from rapidfire_hf.config import ConfigError, RapidFireConfig, env_overrides, load_config

NAN, INF = math.nan, math.inf

# refused since issue 16: integers without an upper bound before
UNBOUNDED_BEFORE = [
    ("gradient", "pipeline_depth", 10**30, "an integer >= 1 and <= 1024"),
    ("gradient", "pipeline_depth", 1025, "an integer >= 1 and <= 1024"),
    ("gradient", "sync_interval", 10**30, "an integer >= 1 and <= 1000000"),
    ("memory", "prefetch_window", 65, "an integer >= 0 and <= 64"),
    ("logging", "log_every", 10**12, "an integer >= 1 and <= 1000000"),
]

# the sweep of every numeric field of RapidFireConfig (refused before issue 16 too: kept refused)
SWEEP = [
    ("gradient", "pipeline_depth", 4.0, "an integer >= 1"),
    ("gradient", "pipeline_depth", NAN, "an integer >= 1"),
    ("gradient", "overlap_factor", NAN, "a number in [0, 1]"),
    ("gradient", "overlap_factor", INF, "a number in [0, 1]"),
    ("gradient", "overlap_factor", -0.1, "a number in [0, 1]"),
    ("gradient", "overlap_factor", "0.5", "a number in [0, 1]"),
    ("gradient", "sync_interval", 0, "an integer >= 1"),
    ("gradient", "bucket_mb", NAN, "a number in [0, 65536]"),
    ("gradient", "bucket_mb", -1, "a number in [0, 65536]"),
    ("gradient", "bucket_mb", INF, "a number in [0, 65536]"),
    ("gradient", "clip_tolerance", 0, "a number in [0.001, 0.999]"),
    ("gradient", "clip_tolerance", 1, "a number in [0.001, 0.999]"),
    ("gradient", "clip_tolerance", NAN, "a number in [0.001, 0.999]"),
    ("memory", "compaction_threshold", 0, "a number in (0, 1]"),
    ("memory", "compaction_threshold", NAN, "a number in (0, 1]"),
    ("memory", "compaction_threshold", 1.5, "a number in (0, 1]"),
    ("memory", "prefetch_window", -1, "an integer >= 0"),
    ("logging", "log_every", 0, "an integer >= 1"),
    ("gradient", "pipeline", "false", "true or false"),
]


@pytest.mark.parametrize(
    "section, key, value, allowed",
    UNBOUNDED_BEFORE + SWEEP,
    ids=[f"{s}.{k}={v!r}" for s, k, v, _ in UNBOUNDED_BEFORE + SWEEP],
)
def test_bad_value_names_key_value_and_range(section, key, value, allowed):
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict({section: {key: value}})
    message = str(info.value)
    assert info.value.key == f"{section}.{key}"
    assert message.startswith(f"{section}.{key}: invalid value; got {value!r}"), message
    assert f"allowed: {allowed}" in message, message


# --------------------------------------------------------------------------------------------- environment
@pytest.mark.parametrize(
    "name, text, value, allowed",
    [
        ("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", str(10**30), 10**30, "an integer >= 1 and <= 1024"),
        ("RAPIDFIRE_GRADIENT_PIPELINE_DEPTH", "10**30", "10**30", "an integer >= 1 and <= 1024"),
        ("RAPIDFIRE_MEMORY_PREFETCH_WINDOW", "1e9", "1e9", "an integer >= 0 and <= 64"),
        ("RAPIDFIRE_GRADIENT_OVERLAP_FACTOR", "nan", NAN, "a number in [0, 1]"),
        ("RAPIDFIRE_PRECISION_FALLBACK", "", "", "or 'none' for no rules"),
        ("RAPIDFIRE_PRECISION_FALLBACK", "  ", "  ", "or 'none' for no rules"),
    ],
)
def test_bad_env_value_is_refused(name, text, value, allowed):
    with pytest.raises(ConfigError) as info:
        env_overrides({name: text})
    message = str(info.value)
    assert message.startswith(f"environment variable {name}: "), message
    assert f"got {value!r}" in message, message
    assert allowed in message, message


def test_none_drops_the_fallback_rules_on_purpose():
    assert env_overrides({"RAPIDFIRE_PRECISION_FALLBACK": "none"}) == {"precision": {"fallback": []}}


@pytest.mark.parametrize(
    "name, suggestion",
    [
        ("rapidfire_gradient_pipeline_depth", "write RAPIDFIRE_GRADIENT_PIPELINE_DEPTH"),
        ("Rapidfire_Memory_Optimization", "write RAPIDFIRE_MEMORY_OPTIMIZATION"),
        ("rapidfire_gradient_pipelinedepth", "write RAPIDFIRE_GRADIENT_PIPELINE_DEPTH"),
    ],
)
def test_wrong_case_config_variable_is_refused(name, suggestion):
    with pytest.raises(ConfigError) as info:
        env_overrides({name: "8"})
    message = str(info.value)
    assert message.startswith(f"environment variable {name}: environment variable names are case-sensitive")
    assert suggestion in message, message


def test_wrong_case_other_rapidfire_variable_warns():
    with pytest.warns(UserWarning, match="rapidfire_cache_dir is not read.*RAPIDFIRE_CACHE_DIR"):
        assert env_overrides({"rapidfire_cache_dir": "/tmp"}) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env_overrides({"RAPIDFIRE_CACHE_DIR": "/tmp", "PATH": "/bin"}) == {}


# ------------------------------------------------------------------------------------------- YAML bombs
def test_alias_bomb_is_refused_with_a_short_message(tmp_path):
    flow = tmp_path / "bomb.yaml"
    # anchors defined inside the value itself: a valid document whose one value expands to 9**5 strings
    inner = '&a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'
    for name, prev in (("b", "a"), ("c", "b"), ("d", "c"), ("e", "d")):
        inner = f"&{name} [[{inner}], " + ", ".join([f"*{prev}"] * 8) + "]"
    flow.write_text(f"gradient:\n  pipeline_depth: [[{inner}], " + ", ".join(["*e"] * 8) + "]\n")
    assert flow.stat().st_size < 400
    with pytest.raises(ConfigError) as info:
        load_config(flow, env=False)
    message = str(info.value)
    assert len(message) < 500, len(message)
    assert "expands to more than 10000 values" in message and str(flow) in message


def test_quoted_values_are_bounded():
    huge = ["x" * 1000] * 1000
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict({"gradient": {"pipeline_depth": huge}})
    assert len(str(info.value)) < 600
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict({"gradient": {"pipeline_depth": "y" * 10**6}})
    message = str(info.value)
    assert len(message) < 600 and "allowed: an integer >= 1" in message


def test_shipped_configs_still_validate():
    from pathlib import Path

    for path in sorted(Path("config").glob("*.yaml")):
        load_config(path, env=False)
