"""chunked_logprobs / chunked_logprobs_and_entropy: forward and gradients against plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.kernels import chunked_logprobs, chunked_logprobs_and_entropy
from rapidfire_hf.kernels.chunked_logprobs import resolve_backend

try:  # TRL >= 1.16's chunked log-prob, the default on CUDA where installed (runs on CPU through torch ops)
    from trl.kernels import ChunkedLogProbFunction  # noqa: F401

    HAVE_TRL_KERNEL = True
except Exception:
    HAVE_TRL_KERNEL = False
BACKENDS = [
    "rapidfire",
    pytest.param("trl", marks=pytest.mark.skipif(not HAVE_TRL_KERNEL, reason="trl < 1.16")),
]

# (N, H, V, chunk): odd shapes, a chunk that does not divide N, and a chunk larger than N
SHAPES = [(7, 16, 131, 3), (513, 32, 1000, 128), (64, 24, 257, 1024)]
# Errors are measured against float64 math on the same inputs, relative to the largest reference value.
# fp32: 1e-5 (measured <= 2e-6 at N=513, V=1000). bf16: the logits matmul output is rounded to bf16
# (8 mantissa bits) before the fp32 softmax, exactly as in plain PyTorch bf16 code, so bf16 must stay
# within 3e-2 (measured <= 1.6e-2 on grad_weight) and within 2x the error of plain PyTorch in bf16.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
NAMES = ("logprobs", "entropy", "grad_hidden", "grad_weight")


def _reference(hidden, weight, tokens, temperature):
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), entropy


def _inputs(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, tokens


def _run(fn, hidden, weight, tokens, temperature, dtype):
    """Forward + backward with fixed random upstream gradients; returns float64 copies of the four results."""
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(len(tokens), generator=g), torch.randn(len(tokens), generator=g)
    lp, ent = fn(h, w, tokens, temperature)
    (lp * up_lp.to(lp.dtype) + ent * up_ent.to(ent.dtype)).sum().backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    return [x.detach().double() for x in (lp, ent, h.grad, w.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,v,chunk", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_grad_match_reference(n, h, v, chunk, dtype, temperature, backend):
    hidden, weight, tokens = _inputs(n, h, v, dtype)  # values exactly representable in dtype

    def ours_fn(h_, w_, t_, temp):
        return chunked_logprobs_and_entropy(h_, w_, t_, temp, chunk, backend=backend)

    truth = _run(_reference, hidden, weight, tokens, temperature, torch.float64)
    ours = _run(ours_fn, hidden, weight, tokens, temperature, dtype)
    plain = _run(_reference, hidden, weight, tokens, temperature, dtype)
    for name, o, p, t in zip(NAMES, ours, plain, truth):
        scale = max(1.0, float(t.abs().max()))
        err, plain_err = float((o - t).abs().max()), float((p - t).abs().max())
        assert err <= REL_TOL[dtype] * scale, (
            f"{name}: max abs error {err:.3g} > {REL_TOL[dtype]} x {scale:.3g}"
        )
        if dtype == torch.bfloat16:
            assert err <= 2 * plain_err + 1e-3, (
                f"{name}: error {err:.3g} vs plain bf16 PyTorch {plain_err:.3g}"
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_only_grad_and_leading_dims(backend):
    hidden, weight, tokens = _inputs(2 * 9, 16, 131, torch.float32, seed=2)
    h3, t2 = hidden.detach().view(2, 9, 16).requires_grad_(), tokens.view(2, 9)
    lp = chunked_logprobs(h3, weight, t2, temperature=1.3, chunk_size=4, backend=backend)
    assert lp.shape == (2, 9)
    lp.sum().backward()
    ref_lp, _ = _reference(hidden.detach(), weight.detach(), tokens, 1.3)
    torch.testing.assert_close(lp.flatten(), ref_lp, atol=1e-5, rtol=1e-5)
    h_ref = hidden.detach().clone().requires_grad_()
    _reference(h_ref, weight.detach(), tokens, 1.3)[0].sum().backward()
    torch.testing.assert_close(h3.grad.flatten(0, 1), h_ref.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_gets_no_grad(backend):
    hidden, weight, tokens = _inputs(7, 16, 131, torch.float32)
    weight.requires_grad_(False)
    chunked_logprobs(hidden, weight, tokens, chunk_size=3, backend=backend).sum().backward()
    assert weight.grad is None and hidden.grad is not None


def test_backend_choice():
    """auto: TRL's function on CUDA where TRL >= 1.16 has it (1.7-2.5x faster on the H200), ours elsewhere."""
    assert resolve_backend("auto", torch.device("cpu")) == "rapidfire"
    assert resolve_backend("auto", torch.device("cuda")) == ("trl" if HAVE_TRL_KERNEL else "rapidfire")
    assert resolve_backend("rapidfire", torch.device("cuda")) == "rapidfire"
    with pytest.raises(ValueError, match="log-prob backend 'fast'"):
        resolve_backend("fast", torch.device("cpu"))


def test_trl_backend_refused_without_trl(monkeypatch):
    import importlib

    mod = importlib.import_module(
        "rapidfire_hf.kernels.chunked_logprobs"
    )  # the package re-exports a same-named function

    monkeypatch.setattr(mod, "_trl_function", lambda: None)
    assert mod.resolve_backend("auto", torch.device("cuda")) == "rapidfire"
    with pytest.raises(ValueError, match="needs trl >= 1.16"):
        mod.resolve_backend("trl", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "rapidfire"])
def test_cuda_bf16_matches_cpu_float64(backend):
    hidden, weight, tokens = _inputs(300, 64, 5003, torch.bfloat16)
    truth = _run(_reference, hidden, weight, tokens, 0.9, torch.float64)
    h = hidden.detach().cuda().requires_grad_()
    w = weight.detach().cuda().requires_grad_()
    lp, ent = chunked_logprobs_and_entropy(h, w, tokens.cuda(), 0.9, 128, backend=backend)
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(300, generator=g).cuda(), torch.randn(300, generator=g).cuda()
    (lp * up_lp + ent * up_ent).sum().backward()
    for name, o, t in zip(NAMES, (lp, ent, h.grad, w.grad), truth):
        scale = max(1.0, float(t.abs().max()))
        err = float((o.detach().double().cpu() - t).abs().max())
        assert err <= REL_TOL[torch.bfloat16] * scale, f"{name}: {err:.3g}"
