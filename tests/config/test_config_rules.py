"""FallbackRule: parsing of conditions and actions, matches(), and the errors for bad rules."""

from __future__ import annotations

import math

import pytest

from rapidfire_hf.config import ConfigError, FallbackRule


@pytest.mark.parametrize(
    "condition, metric, op, threshold",
    [
        ("grad_norm > 1.0", "grad_norm", ">", 1.0),
        ("throughput<100", "throughput", "<", 100.0),
        ("loss >= -2.5", "loss", ">=", -2.5),
        ("loss_scale <= 1e-3", "loss_scale", "<=", 1e-3),
        ("nonfinite_grads != 0", "nonfinite_grads", "!=", 0.0),
        ("approx_kl == .5", "approx_kl", "==", 0.5),
    ],
)
def test_condition_parsing(condition, metric, op, threshold):
    rule = FallbackRule(condition=condition, action="compact_memory")
    assert (rule.metric, rule.op, rule.threshold, rule.layer) == (metric, op, threshold, None)
    assert rule.key == metric


def test_condition_is_normalised_for_round_trip():
    rule = FallbackRule(condition="  throughput<100 ", action=" disable_pipeline ")
    assert rule.to_dict() == {"condition": "throughput < 100", "action": "disable_pipeline"}
    assert FallbackRule.from_dict(rule.to_dict()) == rule


@pytest.mark.parametrize(
    "action, verb, argument, scope",
    [
        ("switch_to fp32", "switch_to", "fp32", None),
        ("switch_to bf16 layer:lm_head", "switch_to", "bf16", "lm_head"),
        ("disable_pipeline", "disable_pipeline", None, None),
        ("enable_pipeline", "enable_pipeline", None, None),
        ("compact_memory", "compact_memory", None, None),
    ],
)
def test_action_parsing(action, verb, argument, scope):
    rule = FallbackRule(condition="loss > 10", action=action)
    assert (rule.verb, rule.argument, rule.scope) == (verb, argument, scope)


def test_matches_compares_and_ignores_missing_metrics():
    rule = FallbackRule(condition="grad_norm > 1.0", action="switch_to fp32")
    assert rule.matches({"grad_norm": 1.5})
    assert not rule.matches({"grad_norm": 1.0})
    assert not rule.matches({"loss": 100.0})
    assert not rule.matches({})
    # NaN compares false except with !=; nonfinite_grads is the metric for NaN gradients
    assert not rule.matches({"grad_norm": math.nan})
    assert FallbackRule(condition="grad_norm != 1", action="compact_memory").matches({"grad_norm": math.nan})


@pytest.mark.parametrize(
    "op, value, expected",
    [
        (">", 2, True),
        (">", 1, False),
        (">=", 1, True),
        ("<", 0.5, True),
        ("<=", 1, True),
        ("==", 1, True),
        ("!=", 1, False),
    ],
)
def test_each_operator(op, value, expected):
    assert (
        FallbackRule(condition=f"loss {op} 1", action="compact_memory").matches({"loss": value}) is expected
    )


def test_layer_condition_and_target_layer():
    rule = FallbackRule(condition="layer:model.layers.3.mlp.grad_norm > 10", action="switch_to fp32")
    assert (rule.layer, rule.metric, rule.key) == (
        "model.layers.3.mlp",
        "grad_norm",
        "layer:model.layers.3.mlp.grad_norm",
    )
    assert rule.target_layer == "model.layers.3.mlp"
    assert rule.matches({"layer:model.layers.3.mlp.grad_norm": 11.0})
    assert not rule.matches({"layer:model.layers.3.mlp.grad_norm": 9.0, "grad_norm": 50.0})
    scoped = FallbackRule(condition="layer_grad_anomaly > 4", action="switch_to fp32 layer:lm_head")
    assert (scoped.layer, scoped.target_layer) == (None, "lm_head")


def test_layer_glob_reports_matching_layers():
    rule = FallbackRule(condition="layer:model.layers.*.mlp.grad_anomaly > 3", action="switch_to fp32")
    metrics = {
        "layer:model.layers.0.mlp.grad_anomaly": 5.0,
        "layer:model.layers.1.mlp.grad_anomaly": 1.0,
        "layer:model.layers.2.self_attn.grad_anomaly": 9.0,
        "layer:model.layers.2.mlp.grad_norm": 9.0,
    }
    assert rule.matched_layers(metrics) == ["model.layers.0.mlp"]
    assert rule.matches(metrics)
    del metrics["layer:model.layers.0.mlp.grad_anomaly"]
    assert not rule.matches(metrics)


@pytest.mark.parametrize(
    "condition, action, key",
    [
        ("grad_norm >> 1.0", "switch_to fp32", "condition"),
        ("grad_norm > one", "switch_to fp32", "condition"),
        ("gradnorm > 1", "switch_to fp32", "condition"),
        ("layer:lm_head.loss > 1", "switch_to fp32", "condition"),
        ("grad_norm > 1", "switch_to fp64", "action"),
        ("grad_norm > 1", "switch_to", "action"),
        ("grad_norm > 1", "disable_pipeline now", "action"),
        ("grad_norm > 1", "restart", "action"),
        (3, "compact_memory", "condition"),
    ],
)
def test_bad_rules_name_key_value_and_syntax(condition, action, key):
    with pytest.raises(ConfigError) as info:
        FallbackRule(condition=condition, action=action)
    bad = condition if key == "condition" else action
    message = str(info.value)
    assert info.value.key == key and message.startswith(f"{key}:")
    assert repr(bad) in message
    expected = "'<metric> <op> <number>'" if key == "condition" else "'switch_to <dtype> [layer:<name>]'"
    assert expected in message


def test_from_dict_rejects_missing_and_unknown_keys():
    with pytest.raises(ConfigError, match=r"action: missing key"):
        FallbackRule.from_dict({"condition": "loss > 1"})
    with pytest.raises(ConfigError, match=r"acton: unknown key \(did you mean 'action'\?\)"):
        FallbackRule.from_dict({"condition": "loss > 1", "acton": "compact_memory"})
