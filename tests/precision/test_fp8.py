"""FP8 linear: numerics against F.linear (torch._scaled_mm runs on CPU too), and the refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rapidfire_hf.precision import (
    Float8Linear,
    convert_linears_to_fp8,
    enable_fp8,
    fp8_candidates,
    fp8_support,
    resolve_fp8_backend,
)
from rapidfire_hf.precision import fp8 as fp8_module
from rapidfire_hf.utils import imports
from rapidfire_hf.utils.imports import is_available

HAS_TORCHAO = is_available("torchao")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_float8_linear_matches_linear_forward_and_backward(bias):
    torch.manual_seed(0)
    ref = nn.Linear(64, 48, bias=bias)
    fp8 = Float8Linear.from_linear(ref)
    assert fp8.weight is ref.weight  # same Parameter: the optimizer is unaffected
    x = torch.randn(2, 16, 64, requires_grad=True)
    x8 = x.detach().clone().requires_grad_(True)
    g = torch.randn(2, 16, 48)

    y_ref = ref(x)
    (gx_ref, gw_ref) = torch.autograd.grad(y_ref, [x, ref.weight], g)
    y = fp8(x8)
    (gx, gw) = torch.autograd.grad(y, [x8, fp8.weight], g)

    # e4m3 keeps 3 mantissa bits (relative step 2**-4 = 6%); averaged over a dot product of 64 terms the
    # error is a few percent; e5m2 gradients (2 bits) give a little more.
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    assert _rel(y, y_ref) < 0.05
    assert _rel(gx, gx_ref) < 0.08
    assert _rel(gw, gw_ref) < 0.08
    assert _rel(y, y_ref) > 0  # it really ran in FP8


def test_float8_linear_falls_back_for_shapes_scaled_mm_rejects():
    ref = nn.Linear(24, 16)  # 24 is not a multiple of 16
    x = torch.randn(5, 24)
    assert torch.equal(Float8Linear.from_linear(ref)(x), ref(x))


def test_candidates_and_refusal_on_cpu():
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 1000), nn.Linear(64, 64))
    # 1000 is not a multiple of 16, 64 is too small
    assert fp8_candidates(model, min_features=1024) == ["0"]
    # the default threshold (4096) leaves 2048-wide layers alone (FP8 lost end to end at that width on an H200)
    assert fp8_candidates(model) == []
    assert fp8_candidates(nn.Sequential(nn.Linear(4096, 11008), nn.Linear(2048, 5632))) == ["0"]
    ok, why = fp8_support("cpu")
    assert not ok and "compute capability >= 8.9" in why and "cpu" in why
    with pytest.raises(RuntimeError, match="compute capability"):
        enable_fp8(model)


# -- backend selection (torchao's presence is what it depends on: both cases are set up explicitly) ----------


@pytest.fixture
def without_torchao(monkeypatch):
    real = imports.is_available
    monkeypatch.setattr(imports, "is_available", lambda name: name != "torchao" and real(name))


@pytest.fixture
def with_torchao(monkeypatch):
    # the selection only asks whether torchao is there; importing it is convert_linears_to_fp8's business
    real_available, real_require = imports.is_available, imports.require
    monkeypatch.setattr(imports, "is_available", lambda name: name == "torchao" or real_available(name))
    monkeypatch.setattr(
        imports,
        "require",
        lambda name, feature=None: None if name == "torchao" else real_require(name, feature),
    )


@pytest.mark.parametrize(
    "backend,recipe,expected",
    [("auto", "tensorwise", "scaled_mm"), ("scaled_mm", "tensorwise", "scaled_mm")],
)
def test_resolve_backend_without_torchao(without_torchao, backend, recipe, expected):
    assert resolve_fp8_backend(backend, recipe) == expected


@pytest.mark.parametrize(
    "backend,recipe,expected",
    [
        ("auto", "tensorwise", "torchao"),
        ("auto", "rowwise", "torchao"),
        ("torchao", "rowwise_with_gw_hp", "torchao"),
        ("scaled_mm", "tensorwise", "scaled_mm"),  # an explicit choice of our own layer is kept
    ],
)
def test_resolve_backend_with_torchao(with_torchao, backend, recipe, expected):
    assert resolve_fp8_backend(backend, recipe) == expected


@pytest.mark.parametrize("backend,recipe", [("torchao", "tensorwise"), ("auto", "rowwise")])
def test_torchao_needed_and_missing_names_the_extra(without_torchao, backend, recipe):
    with pytest.raises(ImportError, match=r"pip install 'rapidfire_hf\[fp8\]'"):
        resolve_fp8_backend(backend, recipe)
    # enable_fp8 says so before it looks at the hardware (on CPU that would be the other error)
    with pytest.raises(ImportError, match="torchao"):
        enable_fp8(nn.Sequential(nn.Linear(2048, 2048)), backend=backend, recipe=recipe)


@pytest.mark.parametrize(
    "backend,recipe,match",
    [
        ("scaled_mm", "rowwise", "per tensor only"),
        ("cublas", "tensorwise", "backend must be one of"),
        ("auto", "blockwise", "recipe must be one of"),
    ],
)
def test_bad_backend_or_recipe_is_a_value_error(backend, recipe, match):
    with pytest.raises(ValueError, match=match):
        resolve_fp8_backend(backend, recipe)
    with pytest.raises(ValueError, match=match):
        enable_fp8(nn.Sequential(nn.Linear(2048, 2048)), backend=backend, recipe=recipe)


def test_enable_fp8_auto_without_torchao_uses_our_layer(without_torchao, monkeypatch):
    monkeypatch.setattr(fp8_module, "fp8_support", lambda device=None: (True, ""))
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 64))
    assert enable_fp8(model, min_features=1024) == ["0"]
    assert type(model[0]) is Float8Linear and type(model[1]) is nn.Linear


def test_convert_rejects_unresolved_backend():
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        convert_linears_to_fp8(nn.Sequential(nn.Linear(32, 32)), ["0"], backend="auto")


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'rapidfire_hf[fp8]')")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_backend_matches_linear_on_cpu(recipe):
    # torchao's float8 layers run on CPU too (torch._scaled_mm): numerics against the bf16 layer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.GELU(), nn.Linear(64, 48, bias=False)).bfloat16()
    ref = copy.deepcopy(model)
    weight = model[0].weight
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    assert convert_linears_to_fp8(model, ["0", "2"], backend="torchao", recipe=recipe) == ["0", "2"]
    assert type(model[0]) is not nn.Linear and model[0].weight is weight  # same Parameter
    y, y_ref = model(x), ref(x)
    y.float().pow(2).mean().backward()
    y_ref.float().pow(2).mean().backward()
    # two FP8 layers in a row, each a few percent off (e4m3: 3 mantissa bits), as our own layer's test
    assert 0 < _rel(y, y_ref) < 0.08
    assert _rel(model[0].weight.grad, ref[0].weight.grad) < 0.12


@pytest.mark.gpu
def test_enable_fp8_on_gpu_converts_large_linears_or_explains():
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048)).cuda().bfloat16()
    ok, why = fp8_support("cuda")
    if not ok:
        with pytest.raises(RuntimeError, match="8.9"):
            enable_fp8(model)
        return
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    ref = model(x)
    assert enable_fp8(model, backend="scaled_mm", min_features=1024) == ["0", "2"]
    assert isinstance(model[0], Float8Linear)
    out = model(x)
    out.float().pow(2).mean().backward()
    assert _rel(out, ref) < 0.1 and torch.isfinite(model[0].weight.grad).all()


# -- the quantisation itself, against a plain reference ----------------------------------------------------

# (fp8 dtype, half the relative spacing of its normal numbers, half its smallest subnormal step)
_FORMATS = [(torch.float8_e4m3fn, 2.0**-4, 2.0**-10), (torch.float8_e5m2, 2.0**-3, 2.0**-17)]


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,rel,sub", _FORMATS)
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 300.0])
def test_quantize_matches_plain_reference(src, fmt, rel, sub, magnitude):
    torch.manual_seed(0)
    t = (torch.randn(48, 32) * magnitude).to(src)
    q, inv = fp8_module._quantize(t, fmt)
    assert q.dtype == fmt and q.shape == t.shape and inv.dtype == torch.float32 and inv.dim() == 0
    fmax = torch.finfo(fmt).max
    scale = 1.0 / inv.double().item()
    amax = t.double().abs().max().item()
    # power-of-two scale, the largest one that keeps amax * scale within the FP8 range
    assert math.log2(scale) == int(math.log2(scale))
    assert fmax / 2 < amax * scale <= fmax
    # bit-identical to a plain fp32 scale-and-cast (the scaling is exact, so only the FP8 cast rounds)
    reference = (t.float() * scale).to(fmt)
    assert torch.equal(q.view(torch.uint8), reference.view(torch.uint8))
    # dequantised: within half an FP8 step of the input, element by element
    back, exact = q.double() * inv.double(), t.double()
    bound = torch.maximum(exact.abs() * rel, torch.full_like(exact, sub * inv.double().item()))
    assert ((back - exact).abs() <= bound * (1 + 1e-9)).all()


def test_quantize_zero_and_tiny_fp16_tensors_stay_finite():
    q, inv = fp8_module._quantize(torch.zeros(16, 16, dtype=torch.bfloat16), torch.float8_e4m3fn)
    assert torch.equal(q.float(), torch.zeros(16, 16)) and math.isfinite(inv.item()) and inv.item() > 0
    tiny = torch.full((16, 16), 3e-5, dtype=torch.float16)  # its scale (2**23) does not fit in fp16
    q, inv = fp8_module._quantize(tiny, torch.float8_e5m2)
    assert torch.isfinite(q.float()).all()
    assert torch.allclose(q.float() * inv, tiny.float(), rtol=2.0**-3)


def test_float8_linear_bf16_inputs_give_bf16_outputs_and_grads():
    torch.manual_seed(0)
    ref = nn.Linear(64, 32).bfloat16()
    fp8 = Float8Linear.from_linear(ref)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fp8(x)
    y.float().pow(2).sum().backward()
    assert y.dtype == x.grad.dtype == ref.weight.grad.dtype == torch.bfloat16
    assert _rel(y, ref(x.detach())) < 0.05


# -- the weight cache ---------------------------------------------------------------------------------------
def _cached_pair():
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    plain = Float8Linear.from_linear(ref)
    cached = Float8Linear.from_linear(ref, cache_weight=True)
    return ref, plain, cached


def test_weight_cache_is_reused_while_the_weight_is_unchanged():
    ref, plain, cached = _cached_pair()
    x = torch.randn(32, 64)
    y1 = cached(x)
    first = cached._weight_cache
    y2 = cached(x)
    assert cached._weight_cache is first  # no second cast of the weight
    assert torch.equal(y1, y2) and torch.equal(y1, plain(x))


@pytest.mark.parametrize("optimizer_kwargs", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_weight_cache_follows_optimizer_steps(optimizer_kwargs):
    # a fused AdamW step changes the weight without bumping its version counter: the global step hook
    # must still invalidate the cache
    ref, plain, cached = _cached_pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, **optimizer_kwargs)
    x = torch.randn(32, 64)
    cached(x).sum().backward()
    opt.step()
    opt.zero_grad()
    assert torch.equal(cached(x), plain(x))


def test_weight_cache_follows_in_place_edits_and_load_state_dict():
    ref, plain, cached = _cached_pair()
    x = torch.randn(32, 64)
    cached(x)
    with torch.no_grad():
        ref.weight.mul_(3.0)
    assert torch.equal(cached(x), plain(x))
    ref.load_state_dict(nn.Linear(64, 48).state_dict())
    assert torch.equal(cached(x), plain(x))
    ref.weight.data = torch.randn(48, 64)  # a new storage
    assert torch.equal(cached(x), plain(x))


def test_weight_cache_needs_clearing_after_writes_through_data():
    ref, plain, cached = _cached_pair()
    x = torch.randn(32, 64)
    cached(x)
    ref.weight.data.mul_(3.0)  # invisible to version counter, storage and optimizer hook (documented)
    assert not torch.equal(cached(x), plain(x))
    cached.clear_weight_cache()
    assert torch.equal(cached(x), plain(x))


def test_enable_fp8_passes_cache_weights(monkeypatch):
    model = nn.Sequential(nn.Linear(2048, 2048))
    monkeypatch.setattr(fp8_module, "fp8_support", lambda device=None: (True, ""))
    assert enable_fp8(model, backend="scaled_mm", cache_weights=True, min_features=1024) == ["0"]
    assert isinstance(model[0], Float8Linear) and model[0].cache_weight


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'rapidfire_hf[fp8]')")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_enable_fp8_torchao_on_gpu(recipe):
    ok, why = fp8_support("cuda")
    if not ok:
        pytest.skip(why)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048)).cuda().bfloat16()
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    ref = model(x).detach()
    weight = model[0].weight
    assert enable_fp8(model, backend="torchao", recipe=recipe, min_features=1024) == ["0", "2"]
    assert type(model[0]) is not nn.Linear and model[0].weight is weight
    out = model(x)
    out.float().pow(2).mean().backward()
    assert 0 < _rel(out, ref) < 0.1 and torch.isfinite(weight.grad).all()
