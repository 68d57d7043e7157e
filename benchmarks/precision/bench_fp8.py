"""FP8 vs bf16 forward+backward time of the linear layers of the 1.1B Llama shape.

22 layers, hidden 2048, 32 heads / 4 KV heads (k, v project to 256), MLP 5632; 16 x 512 tokens. Only the
linears, an RMS norm before each block (as in Llama) and the element-wise glue between them run (no
attention kernel), so the time is mostly that of what FP8 changes. Without the norms the stack is not a
model: the MLP is quadratic in its input, activations grow ~x100 per layer and overflow bf16 by layer 5
(which made the H200 run of 2026-11-30 report a NaN error). FP8 layers: those ``enable_fp8`` selects
(min(in, out) >= 1024: q, o, gate, up, down).

Two FP8 timings: ``fp8_ms`` re-quantises every weight in every call (each step of training without
gradient accumulation), ``fp8_cached_ms`` keeps the FP8 weights between calls (``cache_weights=True``;
the weights do not change between the timed iterations, as within a gradient-accumulation window).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from rapidfire_hf.precision import Float8Linear, enable_fp8, fp8_support


class _Layer(nn.Module):
    def __init__(self, hidden: int, kv: int, mlp: int):
        super().__init__()
        self.q, self.o = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.k, self.v = nn.Linear(hidden, kv, bias=False), nn.Linear(hidden, kv, bias=False)
        self.gate, self.up = nn.Linear(hidden, mlp, bias=False), nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x):
        h = F.rms_norm(x, x.shape[-1:])
        x = x + self.o(self.q(h)) + (self.k(h) * self.v(h)).mean(-1, keepdim=True)
        h = F.rms_norm(x, x.shape[-1:])
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _stack(shape: dict, device) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        layers = [_Layer(shape["hidden"], shape["kv"], shape["mlp"]) for _ in range(shape["layers"])]
        model = nn.Sequential(*layers).to(torch.bfloat16)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    return model


def _time(model, x, iters: int, warmup: int) -> tuple[float, float]:
    times, out = [], None
    for i in range(warmup + iters):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(x)
        out.float().pow(2).mean().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), out.detach()


def _convert(model: nn.Module, ok: bool, cache: bool) -> int:
    if ok:
        return len(enable_fp8(model, backend="scaled_mm", cache_weights=cache))
    # smoke on CPU: exercise the FP8 layer (torch._scaled_mm runs there), timing is meaningless
    for layer in model:
        for name in ("q", "o", "gate", "up", "down"):
            setattr(layer, name, Float8Linear.from_linear(getattr(layer, name), cache_weight=cache))
    return 5 * len(model)


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def run(smoke: bool, device: torch.device) -> dict:
    """Median ms per forward+backward for bf16 and FP8 (or why FP8 was not measured)."""
    if smoke:
        shape = dict(hidden=64, kv=16, mlp=128, layers=2, tokens=32)
        iters, warmup = 1, 0
    else:
        shape = dict(hidden=2048, kv=256, mlp=5632, layers=22, tokens=16 * 512)
        iters, warmup = 20, 5
    ok, why = fp8_support(device)
    result = {"shape": shape, "fp8_available": ok, "fp8_unavailable_reason": why or None}
    if not ok and not smoke:
        model = _stack(shape, device)
        x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16)
        result["bf16_ms"], _ = _time(model, x, iters, warmup)
        return result
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16)
    model = _stack(shape, device)
    result["bf16_ms"], ref = _time(model, x, iters, warmup)
    result["bf16_output_finite"] = bool(torch.isfinite(ref).all())
    for key, cache in (("fp8", False), ("fp8_cached", True)):
        model = _stack(shape, device)  # same seed: the same weights as the bf16 run
        result["fp8_layers"] = _convert(model, ok, cache)
        result[f"{key}_ms"], out = _time(model, x, iters, warmup)
        result[f"{key}_output_finite"] = bool(torch.isfinite(out).all())
        if key == "fp8":
            result["speedup"] = result["bf16_ms"] / result["fp8_ms"]
            result["output_rel_error_vs_bf16"] = _rel_error(out, ref)
        else:
            result["speedup_cached"] = result["bf16_ms"] / result["fp8_cached_ms"]
        del model
    return result
