"""AdaptivePrecisionPlugin end to end on a tiny Llama: config, overflow detection, rules, state, accelerate."""

from __future__ import annotations

import math

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.precision import AdaptivePrecisionPlugin, Precision


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(4, 46, (2, 12), generator=g)}


def _overflowing_llama():
    """Tiny Llama whose layer-0 MLP output is ~1e5 in fp32: +inf in fp16 (max 65504), fine in fp32."""
    model = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1e6)
    return model


def _train_step(plugin, model, step, batch):
    with plugin.autocast():
        loss = model(**batch, labels=batch["input_ids"]).loss
    plugin.backward(loss)
    plugin.step()
    plugin.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), plugin.on_step_end(step, {"loss": loss.detach()})


def test_sensitivity_pass_moves_overflowing_layer_to_fp32_and_training_stays_finite():
    model = _overflowing_llama()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # static fp16: broken
        assert not torch.isfinite(model(**_batch(), labels=_batch()["input_ids"]).loss)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = AdaptivePrecisionPlugin(initial="fp16", fallback=[]).attach(model=model, optimizer=opt)
    schedule = plugin.calibrate(_batch())
    assert schedule == {"model.layers.0": "fp32", "model.layers.1": "fp16", "lm_head": "fp16"}
    assert math.isinf(plugin.sensitivity["model.layers.0"].output_error)
    assert plugin.sensitivity["lm_head"].error < plugin.sensitivity_threshold

    losses = [_train_step(plugin, model, step, _batch(step))[0] for step in range(1, 4)]
    assert all(torch.isfinite(loss) for loss in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert plugin.scaler.overflow_counts == [0]
    assert plugin.stats()["switches"] == 1


def test_runtime_overflow_is_traced_to_its_layer_and_switched():
    model = _overflowing_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = AdaptivePrecisionPlugin(initial="fp16", fallback=None).attach(model=model, optimizer=opt)
    before = [p.detach().clone() for p in model.parameters()]

    loss, actions = _train_step(plugin, model, 1, _batch(1))  # no calibration: the probe must catch it
    assert not torch.isfinite(loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the scaler skipped it
    assert [(a.verb, a.argument, a.target) for a in actions] == [("switch_to", "fp32", "model.layers.0")]
    assert "non-finite output" in actions[0].reason
    assert plugin.current is Precision.FP16  # the default model-wide nonfinite rule did not also fire

    for step in range(2, 4):
        loss, actions = _train_step(plugin, model, step, _batch(step))
        assert torch.isfinite(loss) and actions == []
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_rules_from_config_fire_actions_with_reasons():
    from rapidfire_hf.config import load_config

    cfg = load_config(
        {
            "precision": {
                "mode": "adaptive",
                "initial": "bf16",
                "fallback": [
                    {"condition": "layer:lm_head.grad_norm > 1e6", "action": "switch_to fp32"},
                    {"condition": "throughput < 100", "action": "disable_pipeline"},
                    {"condition": "fragmentation > 0.5", "action": "compact_memory"},
                    {"condition": "grad_norm > 1.0", "action": "switch_to fp32"},
                ],
            }
        },
        env=False,
    )
    model = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    calls = []
    plugin = AdaptivePrecisionPlugin.from_config(cfg, rule_cooldown_steps=5).attach(
        model=model,
        handlers={"disable_pipeline": lambda: calls.append("off")},
        compact_memory=lambda: calls.append("compact"),
    )
    assert plugin.on_step_end(1, {"grad_norm": 0.5, "throughput": 500.0, "fragmentation": 0.1}) == []

    # a layer metric (what observe_gradients queues) -> only that layer is switched
    acts = plugin.on_step_end(2, {"layer:lm_head.grad_norm": 2e6, "throughput": torch.tensor(50.0)})
    assert [(a.verb, a.argument, a.target) for a in acts] == [
        ("switch_to", "fp32", "lm_head"),
        ("disable_pipeline", None, None),
    ]
    assert "lm_head=2e+06" in acts[0].reason and "throughput=50" in acts[1].reason
    assert plugin.precision_of("lm_head") is Precision.FP32 and plugin.current is Precision.BF16

    acts = plugin.on_step_end(3, {"grad_norm": 3.0, "fragmentation": 0.9, "throughput": 50.0})
    assert [(a.verb, a.argument) for a in acts] == [("compact_memory", None), ("switch_to", "fp32")]
    assert plugin.current is Precision.FP32
    assert calls == ["off", "compact"]  # disable_pipeline is in cooldown at step 3

    stats = plugin.stats()
    assert stats["switches"] == 2 and stats["actions"] == {
        "switch_to": 2,
        "disable_pipeline": 1,
        "compact_memory": 1,
    }
    assert stats["switches_per_hour"] > 0


def test_bad_rules_are_rejected_through_the_plugin():
    from rapidfire_hf.config import ConfigError

    with pytest.raises(ConfigError, match="switch_to"):
        AdaptivePrecisionPlugin.from_config(
            {"precision": {"fallback": [{"condition": "loss > 1", "action": "switch_to fp64"}]}}
        )
    with pytest.raises(ConfigError, match="condition"):
        AdaptivePrecisionPlugin(fallback=[{"condition": "grad_nrom > 1", "action": "switch_to fp32"}])
    with pytest.raises(ValueError, match="sensitive_precision"):
        AdaptivePrecisionPlugin(initial="bf16", sensitive_precision="bf16")


def test_environment_overrides_unset_fields_only(monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_PRECISION_INITIAL", "fp16")
    monkeypatch.setenv("RAPIDFIRE_PRECISION_FALLBACK", "loss > 5 -> compact_memory")
    monkeypatch.setenv("RAPIDFIRE_PRECISION_SENSITIVITY_THRESHOLD", "0.5")
    plugin = AdaptivePrecisionPlugin(sensitivity_threshold=0.1)
    assert plugin.initial is Precision.FP16 and plugin.sensitivity_threshold == 0.1
    assert [r.action for r in plugin.fallback] == ["compact_memory"]
    monkeypatch.setenv("RAPIDFIRE_PRECISION_SENSITIVITY_BATCHES", "two")
    with pytest.raises(ValueError, match="RAPIDFIRE_PRECISION_SENSITIVITY_BATCHES"):
        AdaptivePrecisionPlugin()


def test_state_dict_round_trip_restores_schedule_scales_and_history():
    model = _overflowing_llama()
    opt = torch.optim.AdamW([{"params": model.model.parameters()}, {"params": model.lm_head.parameters()}])
    plugin = AdaptivePrecisionPlugin(
        initial="fp16", fallback=[{"condition": "loss > 100", "action": "switch_to bf16 layer:lm_head"}]
    )
    plugin.attach(model=model, optimizer=opt)
    plugin.calibrate(_batch())
    _train_step(plugin, model, 1, _batch(1))
    plugin.on_step_end(2, {"loss": 1e3})
    state = plugin.state_dict()
    torch.save(state, "/dev/null")  # plain types: savable by accelerate.save_state / torch.save

    model2 = _overflowing_llama()
    opt2 = torch.optim.AdamW([{"params": model2.model.parameters()}, {"params": model2.lm_head.parameters()}])
    restored = AdaptivePrecisionPlugin(initial="fp16", fallback=[]).attach(model=model2, optimizer=opt2)
    restored.load_state_dict(state)
    assert restored.state_dict() | {"elapsed_s": 0} == state | {"elapsed_s": 0}
    assert restored.precision_of("model.layers.0") is Precision.FP32
    assert restored.precision_of("lm_head") is Precision.BF16
    assert [str(a) for a in restored.history] == [str(a) for a in plugin.history]
    assert restored.calibration_done and restored.calibrate(_batch()) is None
    # the restored schedule is live: layer 0 runs in fp32, so the fp16 run is finite
    with torch.no_grad(), restored.autocast():
        assert torch.isfinite(model2(**_batch(), labels=_batch()["input_ids"]).loss)


def _accelerated(mixed_precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: other tests set it
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision)
    model = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return accelerator, model, opt


def test_attach_to_accelerator_drives_steps_and_checkpoints(tmp_path):
    # accelerate has no fp16 on CPU: the plugin's own autocast/scaler do the fp16 work here
    accelerator, model, opt = _accelerated("no")
    plugin = AdaptivePrecisionPlugin(initial="fp16", fallback=[]).attach(accelerator)
    assert accelerator.rapidfire_precision is plugin
    assert plugin.model is accelerator.unwrap_model(model) and plugin.optimizer is opt
    assert set(plugin.layers) == {"model.layers.0", "model.layers.1", "lm_head"}
    before = [p.detach().clone() for p in model.parameters()]

    for step in range(1, 3):
        batch = _batch(step)
        with plugin.autocast():
            loss = model(**batch, labels=batch["input_ids"]).loss
        plugin.backward(loss)
        plugin.step(opt)
        opt.zero_grad()
        plugin.on_step_end(step, {"loss": loss.detach()})
        assert torch.isfinite(loss)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert plugin.last_metrics["nonfinite_grads"] == 0 and "layer:lm_head.grad_norm" in plugin.last_metrics

    plugin.set_precision("fp32", "lm_head", reason="test")
    accelerator.save_state(tmp_path / "ckpt")
    plugin.set_precision("fp16", "lm_head", reason="test")
    accelerator.load_state(tmp_path / "ckpt")
    assert plugin.precision_of("lm_head") is Precision.FP32
    assert plugin.scaler.get_scales() == [2.0**16]


@pytest.mark.gpu
def test_attach_replaces_the_fp16_grad_scaler_of_accelerate():
    accelerator, model, opt = _accelerated("fp16")
    plugin = AdaptivePrecisionPlugin(initial="fp16").attach(accelerator)
    assert accelerator.scaler is plugin.scaler and opt.scaler is plugin.scaler
    batch = {k: v.cuda() for k, v in _batch().items()}
    loss = model(**batch, labels=batch["input_ids"]).loss
    accelerator.backward(loss)
    plugin.observe_gradients()
    opt.step()
    plugin.on_step_end(1, {"loss": loss.detach()}, wait=True)
    assert torch.isfinite(loss) and not opt.step_was_skipped


def test_calibrate_through_accelerate_autocast_wrapped_forward():
    # accelerate (bf16 on CPU) wraps model.forward in autocast, which the reference run must survive
    accelerator, model, opt = _accelerated("bf16")
    plugin = AdaptivePrecisionPlugin(initial="bf16", fallback=[]).attach(accelerator)
    schedule = plugin.calibrate(_batch())
    assert schedule == {"model.layers.0": "bf16", "model.layers.1": "bf16", "lm_head": "bf16"}
    assert all(0 < r.error < plugin.sensitivity_threshold for r in plugin.sensitivity.values())


def test_pipeline_rules_read_and_switch_the_rapidfire_optimizer_by_type(caplog):
    """Without a handler, pipeline rules act on the RapidFireOptimizer (also behind accelerate's wrapper)
    and read its state, so a rule whose state already holds is not an action; another optimizer with a
    method of the same name is not called (no duck typing), and its rules say nothing handles them."""
    import logging
    import types

    from rapidfire_hf.optim import RapidFireOptimizer

    rules = [
        {"condition": "throughput < 100", "action": "disable_pipeline"},
        {"condition": "throughput > 1000", "action": "enable_pipeline"},
    ]
    model = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1)
    opt = RapidFireOptimizer(model.parameters(), lr=0.1, gradient_pipeline=True)
    wrapped = types.SimpleNamespace(optimizer=opt, scaler=None)  # what accelerate.prepare returns
    plugin = AdaptivePrecisionPlugin(initial="bf16", fallback=rules, rule_cooldown_steps=0)
    plugin.attach(model=model, optimizer=wrapped)
    assert plugin.on_step_end(1, {"throughput": 2000.0}) == []  # already on: no action
    assert [a.verb for a in plugin.on_step_end(2, {"throughput": 50.0})] == ["disable_pipeline"]
    assert not opt.pipeline_enabled
    opt.enable_pipeline()  # switched back by someone else: the rule reads the optimizer, not its memory
    assert [a.verb for a in plugin.on_step_end(3, {"throughput": 50.0})] == ["disable_pipeline"]
    assert [a.verb for a in plugin.on_step_end(4, {"throughput": 5000.0})] == ["enable_pipeline"]
    assert opt.pipeline_enabled
    state = plugin.state_dict()
    assert state["rule_last_fired"] == {0: 3, 1: 4} and state["pipeline_enabled"] is True

    class DuckOptimizer(torch.optim.SGD):
        def disable_pipeline(self):
            raise AssertionError("a method found by name was called")

    duck = AdaptivePrecisionPlugin(initial="bf16", fallback=rules[:1]).attach(
        model=model, optimizer=DuckOptimizer(model.parameters(), lr=0.1)
    )
    with caplog.at_level(logging.WARNING, logger="rapidfire_hf"):
        assert duck.on_step_end(1, {"throughput": 50.0}) == []
    assert "nothing handles 'disable_pipeline'" in caplog.text
