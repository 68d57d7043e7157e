"""The routed MoE decode (rollout/moe_decode.py) against the models' own MoE blocks (CPU, fp32), and proof
that it has no host sync or data-dependent shape, so a CUDA graph can record it."""

from __future__ import annotations

import pytest
import torch
from family_cases import build, case
from torch.fx.experimental.proxy_tensor import make_fx

from rapidfire_hf.rollout.llama_forward import StaticLlama
from rapidfire_hf.rollout.moe_decode import moe_layout_reason, routed_moe

# (case, config overrides): the tiny cases and a Qwen3-30B-A3B-like routing (8 of 128 experts)
SHAPES = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": True}),
    (
        "qwen3_moe",
        {"num_experts": 128, "num_experts_per_tok": 8, "mlp_only_layers": [], "num_hidden_layers": 1},
    ),
    ("mixtral", {}),
    ("mixtral", {"num_local_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 1}),
]


def _moe_blocks(name, overrides):
    model = build(case(name), 64, **overrides)
    return model, [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("form", ["gather", "dense", None])
@pytest.mark.parametrize("name,overrides", SHAPES)
def test_routed_moe_equals_the_models_block(name, overrides, form):
    model, blocks = _moe_blocks(name, overrides)
    assert blocks
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    torch.manual_seed(0)
    for mlp in blocks:
        assert moe_layout_reason(mlp, model.config) is None
        for batch in (1, 8, 64):
            h = torch.randn(batch, model.config.hidden_size)
            with torch.no_grad():
                ref = mlp(h[:, None, :])
                ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1)
                out = routed_moe(mlp, h, model.config.model_type, norm, form)
            assert (out - ref).abs().max() <= 1e-6 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_decode_step_runs_routed_moe_and_has_no_host_sync(name):
    """The decode step traced with fake tensors: a host read (``.item``, ``nonzero``, a data-dependent
    shape) cannot be traced at all, and none of the ops that make one appear in the graph."""
    model = build(case(name), 64)
    net = StaticLlama(model, attention="matmul")
    moe_layers = [i for i, layer in enumerate(net.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers and all(net.moe_native[i] for i in moe_layers) and net.moe_reason is None
    b, length = 4, 16
    k, v = net.new_cache(b, length, "cpu")
    pos = torch.arange(length).expand(b, length)
    cos, sin = net.rope_table(pos)
    valid = torch.ones(b, length, dtype=torch.bool)

    def step(tokens, slot, cos, sin, valid, *cache):
        return net.decode(tokens, slot, cos, sin, valid, list(cache[: len(k)]), list(cache[len(k) :]))

    args = (torch.tensor([3, 4, 5, 6]), torch.tensor([5]), cos[:, :, 5], sin[:, :, 5], valid, *k, *v)
    with torch.no_grad():
        graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert not {o for o in ops if "_local_scalar_dense" in o or "nonzero" in o}, ops
    assert any("topk" in o for o in ops)  # the routing is in the traced step
    # the checker sees a host read where there is one: the model's block with transformers' eager expert
    # loop (a Python loop over the experts that ``nonzero`` found: each iteration reads a value on the host)
    mlp = net.layers[moe_layers[0]].mlp
    model.config._experts_implementation = "eager"
    with torch.no_grad(), pytest.raises(RuntimeError, match="_local_scalar_dense"):
        make_fx(lambda h: mlp(h[:, None, :]))(torch.randn(b, model.config.hidden_size))


def test_unknown_form_is_refused_by_name():
    _, blocks = _moe_blocks("mixtral", {})
    with pytest.raises(ValueError, match="form must be"):
        routed_moe(blocks[0], torch.zeros(2, 64), "mixtral", form="sparse")


def test_unknown_expert_layout_keeps_the_module_call_and_says_so():
    model = build(case("mixtral"), 64)
    for layer in model.model.layers:  # a layout this decode does not know: transposed experts
        layer.mlp.experts.is_transposed = True
    with pytest.warns(UserWarning, match="transposed"):
        net = StaticLlama(model, attention="matmul")
    assert not any(net.moe_native) and "transposed" in net.moe_reason


@pytest.mark.parametrize("form", ["gather", "dense"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_routed_moe_is_bit_exact_in_bf16(name, form):
    """bf16: the routing weights' dtype flow (Qwen3-MoE casts them to bf16, Mixtral keeps fp32 until the
    sum) decides the rounding; equal to the block's default experts implementation bit for bit."""
    model, blocks = _moe_blocks(name, {})
    model.to(torch.bfloat16)
    torch.manual_seed(1)
    h = torch.randn(64, model.config.hidden_size, dtype=torch.bfloat16)
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    with torch.no_grad():
        for mlp in blocks:
            ref = mlp(h[:, None, :])
            ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1)
            assert torch.equal(routed_moe(mlp, h, model.config.model_type, norm, form), ref)
