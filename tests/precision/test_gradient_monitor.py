"""GradientMonitor.collect: per-layer gradient norms and non-finite counts against a plain fp64 reference."""

from __future__ import annotations

import math

import torch
from torch import nn

from rapidfire_hf.precision.metrics import GradientMonitor


def _layers(dtype=torch.float32):
    torch.manual_seed(0)
    layers = {
        "a": nn.Linear(5, 7).to(dtype),
        "b": nn.Sequential(nn.Linear(7, 3), nn.LayerNorm(3), nn.Linear(3, 2)).to(dtype),
        "frozen": nn.Linear(2, 2).to(dtype),
        "c": nn.Linear(2, 4, bias=False).to(dtype),
    }
    for name, layer in layers.items():
        for p in layer.parameters():
            p.grad = None if name == "frozen" else torch.randn_like(p) * (10.0 if name == "c" else 1.0)
    return layers


def _reference(layers, inv_scale=1.0):
    out, total = {}, 0.0
    for name, layer in layers.items():
        grads = [p.grad.double() for p in layer.parameters() if p.grad is not None]
        if not grads:
            continue
        norms = [g.norm() for g in grads]
        bad = sum(0.0 if math.isfinite(n.item()) else 1.0 for n in norms)
        out[f"layer:{name}.grad_norm"] = math.sqrt(sum(n.item() ** 2 for n in norms)) * inv_scale
        out[f"layer:{name}.nonfinite_grads"] = bad
        total += bad
    out["nonfinite_grads"] = total
    return out


def _host(stats):
    return {k: float(v) for k, v in stats.items()}


def test_norms_and_counts_match_the_per_layer_reference():
    layers = _layers()
    monitor = GradientMonitor(layers)
    got, want = _host(monitor.collect(0.5)), _reference(layers, 0.5)
    assert got.keys() == want.keys()  # the layer without gradients is left out
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-6), (key, got[key], value)


def test_non_finite_gradients_are_counted_in_their_own_layer():
    layers = _layers()
    b = list(layers["b"].parameters())
    b[0].grad[0, 0] = float("inf")
    b[3].grad[1] = float("nan")
    got = _host(GradientMonitor(layers).collect())
    assert got["layer:b.nonfinite_grads"] == 2.0 and math.isnan(got["layer:b.grad_norm"])
    assert got["layer:a.nonfinite_grads"] == 0.0 and math.isfinite(got["layer:a.grad_norm"])
    assert got["nonfinite_grads"] == 2.0
    # the last layer alone (not the middle one, which a reversed layer order would leave in place)
    layers = _layers()
    layers["c"].weight.grad[0, 0] = float("inf")
    got = _host(GradientMonitor(layers).collect())
    assert got["layer:c.nonfinite_grads"] == 1.0 and math.isinf(got["layer:c.grad_norm"])
    assert got["layer:a.nonfinite_grads"] == got["layer:b.nonfinite_grads"] == 0.0


def test_bf16_gradients_are_normed_in_fp32_and_a_changed_set_of_gradients_is_followed():
    layers = _layers(torch.bfloat16)
    monitor = GradientMonitor(layers)
    for key, value in _reference(layers).items():  # bf16 values, norms accumulated in fp32
        assert math.isclose(_host(monitor.collect())[key], value, rel_tol=1e-5), key
    layers["a"].bias.grad = None  # the next step: another set of parameters holds gradients
    for p in layers["frozen"].parameters():
        p.grad = torch.ones_like(p)
    got, want = _host(monitor.collect()), _reference(layers)
    assert got.keys() == want.keys() and "layer:frozen.grad_norm" in got
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-5), key


def test_no_gradients_gives_no_statistics():
    layers = _layers()
    for layer in layers.values():
        for p in layer.parameters():
            p.grad = None
    assert GradientMonitor(layers).collect() == {}


def _two_layers():
    layers = {"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)}
    return layers, nn.Sequential(*layers.values())


def test_a_paused_output_probe_has_no_hooks_and_records_nothing_then_records_again():
    """``OutputProbe.paused()``: the layer hooks are off inside (a generation's no-grad forwards would only
    call them), back after, and the probe flags a non-finite output again; a removed probe stays removed."""
    from rapidfire_hf.precision.metrics import OutputProbe

    layers, model = _two_layers()
    probe = OutputProbe(layers)
    bad = torch.full((2, 3), float("inf"))
    with probe.paused():
        assert all(not m._forward_hooks for m in layers.values())
        model(bad)  # under gradients: a hooked probe would flag it
        assert probe.collect() == {}
    assert all(len(m._forward_hooks) == 1 for m in layers.values())
    model(bad)
    flags = probe.collect()
    assert (
        flags["layer:a.nonfinite_outputs"].item() == 1.0 and flags["layer:b.nonfinite_outputs"].item() == 1.0
    )
    probe.remove()
    with probe.paused():
        pass
    assert all(not m._forward_hooks for m in layers.values())


def test_a_probe_paused_by_an_error_is_hooked_again():
    from rapidfire_hf.precision.metrics import OutputProbe

    layers, _ = _two_layers()
    probe = OutputProbe(layers)
    try:
        with probe.paused():
            raise RuntimeError("generation failed")
    except RuntimeError:
        pass
    assert all(len(m._forward_hooks) == 1 for m in layers.values())
