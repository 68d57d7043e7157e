"""FP8 vs bf16 forward+backward time of the linear layers of the 1.1B Llama shape.

22 layers, hidden 2048, 32 heads / 4 KV heads (k, v project to 256), MLP 5632; 16 x 512 tokens. Only the
linears and the element-wise glue between them run (no attention kernel, no norms), so the time is that of
what FP8 changes. FP8 layers: those ``enable_fp8`` selects (min(in, out) >= 1024: q, o, gate, up, down).
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
        x = x + self.o(self.q(x)) + (self.k(x) * self.v(x)).mean(-1, keepdim=True)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


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
    model = _stack(shape, device)
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16)
    result["bf16_ms"], ref = _time(model, x, iters, warmup)
    if ok:
        result["fp8_layers"] = len(enable_fp8(model, backend="scaled_mm"))
    elif smoke:  # exercise the FP8 layer on CPU (torch._scaled_mm runs there), timing is meaningless
        for layer in model:
            for name in ("q", "o", "gate", "up", "down"):
                setattr(layer, name, Float8Linear.from_linear(getattr(layer, name)))
        result["fp8_layers"] = 5 * len(model)
    else:
        return result
    result["fp8_ms"], out = _time(model, x, iters, warmup)
    result["speedup"] = result["bf16_ms"] / result["fp8_ms"]
    result["output_rel_error_vs_bf16"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return result
