"""RapidFireConfig sections: defaults, checks, help metadata, to_dict/from_dict/YAML round trips."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from rapidfire_hf.config import (
    ConfigError,
    FallbackRule,
    GradientConfig,
    LoggingConfig,
    MemoryConfig,
    MemoryLevel,
    PrecisionConfig,
    RapidFireConfig,
)


def assert_config_error(info, key, value, allowed):
    """The message names the key path, the bad value and what is allowed."""
    message = str(info.value)
    assert info.value.key == key, message
    assert f"{key}:" in message and repr(value) in message and allowed in message, message


@pytest.mark.parametrize(
    "cls", [GradientConfig, MemoryConfig, PrecisionConfig, LoggingConfig, RapidFireConfig]
)
def test_every_field_has_help(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_enums_are_str_and_compare_to_strings():
    cfg = RapidFireConfig(memory={"optimization": "aggressive"})
    assert cfg.memory.optimization is MemoryLevel.AGGRESSIVE
    assert cfg.memory.optimization == "aggressive"


@pytest.mark.parametrize(
    "section, key, value, allowed",
    [
        ("gradient", "pipeline_depth", "eight", "an integer >= 1"),
        ("gradient", "pipeline_depth", True, "an integer >= 1"),  # bool is not an int
        ("gradient", "pipeline_depth", 8.0, "an integer >= 1"),
        ("gradient", "pipeline_depth", 0, "an integer >= 1"),
        ("gradient", "pipeline", "yes", "true or false"),
        ("gradient", "overlap_factor", 1.5, "a number in [0, 1]"),
        ("gradient", "overlap_factor", float("nan"), "a number in [0, 1]"),
        ("gradient", "sync_interval", -1, "an integer >= 1"),
        ("gradient", "bucket_mb", -1, "a number in [0, 65536]"),
        ("gradient", "bucket_mb", "64MB", "a number in [0, 65536]"),
        ("gradient", "bucket_mb", float("inf"), "a number in [0, 65536]"),
        ("memory", "optimization", "extreme", "one of 'conservative', 'balanced', 'aggressive'"),
        ("memory", "compaction_threshold", 0.0, "a number in (0, 1]"),
        ("memory", "prefetch_window", -1, "an integer >= 0"),
        ("precision", "mode", "dynamic", "one of 'static', 'adaptive'"),
        ("precision", "initial", "fp8", "one of 'bf16', 'fp16', 'fp32'"),
        ("precision", "fallback", "grad_norm > 1", "a list of {condition, action} mappings"),
        ("logging", "level", "verbose", "one of 'debug', 'info', 'warning', 'error'"),
        ("logging", "log_every", 0, "an integer >= 1"),
        ("logging", "report_to", ["wandb", "slack"], "a list of 'wandb', 'tensorboard'"),
        ("logging", "telemetry_dir", 5, "a non-empty string or null"),
    ],
)
def test_bad_values_name_key_value_and_allowed(section, key, value, allowed):
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict({section: {key: value}})
    assert_config_error(info, f"{section}.{key}", value, allowed)


def test_bad_value_in_a_section_built_directly():
    with pytest.raises(ConfigError) as info:
        GradientConfig(pipeline_depth="eight")
    assert_config_error(info, "gradient.pipeline_depth", "eight", "an integer >= 1")


def test_ints_are_accepted_for_floats_and_report_to_accepts_a_string():
    cfg = RapidFireConfig.from_dict({"gradient": {"overlap_factor": 1}, "logging": {"report_to": "wandb"}})
    assert cfg.gradient.overlap_factor == 1.0 and isinstance(cfg.gradient.overlap_factor, float)
    assert RapidFireConfig().gradient.bucket_mb == 256.0
    per_param = RapidFireConfig.from_dict({"gradient": {"bucket_mb": 0}})
    assert per_param.gradient.bucket_mb == 0.0 and isinstance(per_param.gradient.bucket_mb, float)
    assert cfg.logging.report_to == ["wandb"]


@pytest.mark.parametrize(
    "data, key, suggestion",
    [
        ({"gradient": {"pipline_depth": 8}}, "gradient.pipline_depth", "gradient.pipeline_depth"),
        ({"memroy": {}}, "memroy", "memory"),
        ({"precision": {"fallbacks": []}}, "precision.fallbacks", "precision.fallback"),
    ],
)
def test_unknown_key_suggests_closest(data, key, suggestion):
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict(data)
    assert info.value.key == key
    assert f"unknown key (did you mean {suggestion!r}?)" in str(info.value)


def test_unparsable_rule_names_its_index():
    rules = [
        {"condition": "grad_norm > 1.0", "action": "switch_to fp32"},
        {"condition": "tput < 1", "action": "x"},
    ]
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict({"precision": {"fallback": rules}})
    assert_config_error(info, "precision.fallback[1].condition", "tput < 1", "'<metric> <op> <number>'")


def test_section_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        RapidFireConfig.from_dict({"gradient": 8})
    assert_config_error(info, "gradient", 8, "a mapping with keys pipeline, pipeline_depth")


def test_round_trip_through_dict_and_yaml():
    cfg = RapidFireConfig(
        gradient=GradientConfig(
            pipeline=False, pipeline_depth=2, overlap_factor=0.25, sync_interval=3, bucket_mb=16.0
        ),
        memory=MemoryConfig(optimization="conservative", compaction_threshold=1.0, prefetch_window=0),
        precision=PrecisionConfig(
            mode="static",
            initial="fp16",
            fallback=[FallbackRule("layer:lm_head.grad_norm > 10", "switch_to fp32 layer:lm_head")],
        ),
        logging=LoggingConfig(
            level="debug", log_every=1, report_to=["wandb", "tensorboard"], telemetry_dir="/tmp/t"
        ),
    )
    assert RapidFireConfig.from_dict(cfg.to_dict()) == cfg
    assert RapidFireConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    assert cfg.copy() == cfg and cfg.copy() is not cfg
    assert cfg.to_dict()["precision"]["fallback"] == [
        {"condition": "layer:lm_head.grad_norm > 10", "action": "switch_to fp32 layer:lm_head"}
    ]


def test_default_instances_do_not_share_mutable_state():
    a, b = RapidFireConfig(), RapidFireConfig()
    a.precision.fallback.append(FallbackRule("loss > 1", "compact_memory"))
    a.logging.report_to.append("wandb")
    assert len(b.precision.fallback) == 1 and b.logging.report_to == []
