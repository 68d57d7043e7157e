"""Per-layer precision wrappers and asynchronous metrics."""

from __future__ import annotations

import torch
from torch import nn

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.precision import (
    AsyncMetrics,
    Precision,
    find_layers,
    measure_sensitivity,
    set_layer_precision,
)
from rapidfire_hf.precision.schedule import layer_precision


def test_fp32_layer_inside_fp16_autocast_computes_exactly_as_fp32():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    x = torch.randn(4, 16).half()  # an fp16 input, as produced by a previous autocast op
    ref = block(x.float())
    with torch.autocast("cpu", dtype=torch.float16):
        assert block(x.float()).dtype == torch.float16
        set_layer_precision(block, Precision.FP32, cast_back=False)
        out = block(x)
    assert layer_precision(block) is Precision.FP32
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    set_layer_precision(block, None, cast_back=False)
    assert "forward" not in block.__dict__ and layer_precision(block) is None


def test_pure_bf16_model_layer_to_fp32_converts_params_and_casts_back():
    model = build_tiny_llama(None, hidden=32, layers=2, heads=2, kv_heads=1, dtype=torch.bfloat16)
    layer = model.model.layers[1]
    changed = set_layer_precision(layer, Precision.FP32, cast_back=True)
    assert changed and all(p.dtype == torch.float32 for p in layer.parameters())
    out = model(input_ids=torch.randint(4, 46, (1, 6)))  # the next module still receives bf16
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_find_layers_on_llama():
    model = build_tiny_llama(None, hidden=32, layers=3, heads=2, kv_heads=1)
    assert list(find_layers(model)) == ["model.layers.0", "model.layers.1", "model.layers.2", "lm_head"]


def test_async_metrics_keep_step_order_and_convert_tensors():
    queue = AsyncMetrics()
    queue.submit(1, {"loss": torch.tensor(2.5), "grad_norm": 1, "flag": True, "name": "x"})
    queue.submit(2, {"loss": 3.0})
    assert queue.ready() == [(1, {"loss": 2.5, "grad_norm": 1.0}), (2, {"loss": 3.0})]
    assert queue.ready() == []


class _BF16Handoff(nn.Module):
    """Two fp32 layers with a bf16 tensor between them, as when a forward re-enters autocast."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, x):
        h = self.layers[0](x).to(torch.bfloat16)  # layer 1 records a bf16 input, its weights are fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.layers[1](h).float()


def test_sensitivity_pass_accepts_low_precision_recorded_inputs():
    torch.manual_seed(0)
    model = _BF16Handoff()
    rows = measure_sensitivity(model, {"x": torch.randn(4, 8)}, find_layers(model), Precision.BF16)
    assert [r.name for r in rows] == ["layers.0", "layers.1"]
    assert all(0 < r.error < 0.05 for r in rows)
