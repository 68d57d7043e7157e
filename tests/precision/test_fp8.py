"""FP8 linear: numerics against F.linear (torch._scaled_mm runs on CPU too), and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapidfire_hf.precision import Float8Linear, enable_fp8, fp8_candidates, fp8_support
from rapidfire_hf.utils.imports import is_available


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
    assert fp8_candidates(model) == ["0"]  # 1000 is not a multiple of 16, 64 is too small
    ok, why = fp8_support("cpu")
    assert not ok and "compute capability >= 8.9" in why and "cpu" in why
    with pytest.raises(RuntimeError, match="compute capability"):
        enable_fp8(model)


@pytest.mark.skipif(is_available("torchao"), reason="torchao is installed")
def test_torchao_backend_names_the_missing_package():
    with pytest.raises(ImportError, match="pip install torchao"):
        enable_fp8(nn.Sequential(nn.Linear(2048, 2048)), backend="torchao")


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
    assert enable_fp8(model, backend="scaled_mm") == ["0", "2"]
    assert isinstance(model[0], Float8Linear)
    out = model(x)
    out.float().pow(2).mean().backward()
    assert _rel(out, ref) < 0.1 and torch.isfinite(model[0].weight.grad).all()
