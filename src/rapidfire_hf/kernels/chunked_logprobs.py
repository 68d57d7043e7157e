"""Token log-probs (and entropy) straight from hidden states, without a full ``[N, V]`` logits tensor.

Why our own: TRL's ``selective_log_softmax`` / ``selective_log_softmax_and_entropy`` take logits that
already exist as ``[N, V]`` (at N = 32 x 512 tokens and V = 32000 that is 2 GiB of fp32 per pass, plus
the same again for its gradient). Liger's ``LigerFusedLinearCrossEntropyFunction`` (and torch 2.13's
chunked ``F.linear_cross_entropy``) avoid the logits tensor but compute the gradient inside forward
for a scalar-reduced loss; PPO needs per-token log-probs with arbitrary upstream gradients (ratio x
advantage, clipped), an entropy term and a temperature, and the GPU machine runs torch 2.11, which
lacks ``F.linear_cross_entropy``. So: forward keeps only the per-token log-sum-exp, and backward
recomputes each chunk's logits (one extra ``[chunk, H] x [H, V]`` matmul per chunk).

Liger 0.8's ``chunked_loss`` PPO/GRPO losses (``LigerFusedLinearPPOBase``) chunk the head too, but compute
their own clipped loss and its gradient inside forward; PPOTrainer's loss (``ppo.core.ppo_loss``, TRL 1.12's
math with value clipping) takes per-token log-probs instead. The per-token piece inside Liger
(``_ChunkedSelectiveLogProbFunction``) is private, gives no entropy, and Liger is an optional dependency.
TRL 1.16 ships ``trl.kernels.ChunkedLogProbFunction`` (cuBLAS tiles of tokens x vocabulary folded into
online log-sum-exp statistics by a Triton kernel, entropy as an optional output). Measured on one H200
(``benchmarks/kernels/logprobs.py``, ``benchmarks/kernels/results/h200/call2``): 1.7-2.5x faster than this
module's chunks at every PPO shape (1.1B, 24,576 tokens: 5.1 against 13.5 ms forward, 21.3 against 46.1 ms
forward+backward) at a few hundred MiB more. So ``backend="auto"`` (the default) uses TRL's function on
CUDA where TRL >= 1.16 is installed, and this module's chunks elsewhere (CPU, TRL 1.12, or
``backend="rapidfire"``); both compute the same per-token log-probs and entropy.

Under ``torch.autocast`` the projection runs in the autocast dtype in forward and in the recompute of
backward alike (backward does not inherit autocast by itself), so both see the same logits.
"""

from __future__ import annotations

import functools

import torch

LOGPROB_BACKENDS = ("auto", "rapidfire", "trl")

# The vocabulary tile TRL's own trainers pass (32,768 >= a 32,000 vocabulary: one tile per token chunk);
# the benchmark above measured TRL's function with it.
TRL_VOCAB_TILE = 32768


@functools.cache  # asked on every log-prob call: import (or fail to import) once per process
def _trl_function():
    """``trl.kernels.ChunkedLogProbFunction`` (TRL >= 1.16), or None where TRL lacks it."""
    try:
        from trl.kernels import ChunkedLogProbFunction
    except Exception:  # TRL missing, older than 1.16, or failing to import: this module's chunks
        return None
    return ChunkedLogProbFunction


def resolve_backend(backend: str, device: torch.device) -> str:
    """Which implementation computes the log-probs of tensors on ``device``: ``"trl"`` or ``"rapidfire"``.

    ``"auto"``: TRL's function on CUDA where it is installed (faster there, see the module docstring), this
    module's chunks otherwise. ``"trl"`` on a machine without TRL >= 1.16 is refused.
    """
    if backend not in LOGPROB_BACKENDS:
        raise ValueError(f"log-prob backend {backend!r}: expected one of {', '.join(LOGPROB_BACKENDS)}")
    if backend == "auto":
        return "trl" if torch.device(device).type == "cuda" and _trl_function() is not None else "rapidfire"
    if backend == "trl" and _trl_function() is None:
        raise ValueError("log-prob backend 'trl' needs trl >= 1.16 (trl.kernels.ChunkedLogProbFunction)")
    return backend


def _trl_logprobs(h, weight, tokens, temperature: float, with_entropy: bool):
    """Flat ``[N]`` log-probs (and entropy, or None) from TRL's function: no bias, no soft-capping."""
    outputs = ("entropy",) if with_entropy else ()
    out = _trl_function().apply(
        h, weight, None, tokens, float(temperature), TRL_VOCAB_TILE, None, 1.0, outputs
    )
    return out[0], out[1]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the projection runs in: the autocast dtype when autocast is on, else the input's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # fp32 softmax math: bf16 log-sum-exp over 32k entries loses ~1e-2 absolute
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits


class ChunkedLogprobsFunction(torch.autograd.Function):
    """Autograd function behind :func:`chunked_logprobs_and_entropy` (see there for the arguments)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size, with_entropy):
        ctx.set_materialize_grads(False)  # entropy is often for logging only: no zero gradient for it
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            logprobs, entropy, lse = _forward(
                hidden, weight, tokens, temperature, chunk_size, with_entropy, dtype
            )
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy, ctx.dtype = (
            temperature,
            chunk_size,
            with_entropy,
            dtype,
        )
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            grad_h, grad_w = _backward(ctx, grad_logprobs, grad_entropy)
        return grad_h, grad_w, None, None, None, None


def _forward(hidden, weight, tokens, temperature, chunk_size, with_entropy, dtype):
    """Per-token log-prob, entropy and log-sum-exp, ``chunk_size`` rows of logits at a time."""
    n = hidden.shape[0]
    w = weight.to(dtype)
    logprobs = hidden.new_empty(n, dtype=torch.float32)
    lse = hidden.new_empty(n, dtype=torch.float32)
    entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        logits = _chunk_logits(hidden[sl].to(dtype), w, temperature)
        lse[sl] = torch.logsumexp(logits, dim=-1)
        logprobs[sl] = logits.gather(-1, tokens[sl, None]).squeeze(-1) - lse[sl]
        if with_entropy:
            probs = torch.exp(logits - lse[sl, None])
            entropy[sl] = lse[sl] - (probs * logits).sum(-1)
    return logprobs, entropy, lse


def _backward(ctx, grad_logprobs, grad_entropy):
    """Gradients of hidden and weight, recomputing each chunk's logits in the forward's dtype."""
    hidden, weight, tokens, lse = ctx.saved_tensors
    t, chunk, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    w = weight.to(dtype)
    grad_h = torch.empty_like(hidden) if need_h else None
    # fp32 accumulator: summing ~N/chunk bf16 partial products in bf16 loses the small ones
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        h = hidden[sl].to(dtype)
        logits = _chunk_logits(h, w, t)
        probs = torch.exp(logits - lse[sl, None])
        if grad_logprobs is not None:
            # d logprob_i / d z_j = 1[j = token_i] - p_j
            dz = probs * -grad_logprobs[sl, None]
            dz.scatter_add_(-1, tokens[sl, None], grad_logprobs[sl, None])
        else:
            dz = torch.zeros_like(logits)
        if grad_entropy is not None:
            # H = lse - sum p z  =>  dH / d z_j = -p_j (z_j - sum_k p_k z_k)
            mean_z = (probs * logits).sum(-1, keepdim=True)
            dz -= grad_entropy[sl, None] * probs * (logits - mean_z)
        if t != 1.0:
            dz = dz / t
        dz = dz.to(dtype)
        if need_h:
            grad_h[sl] = (dz @ w).to(hidden.dtype)
        if need_w:
            grad_w += (dz.t() @ h).float()
    if need_w:
        grad_w = grad_w.to(weight.dtype)
    return grad_h, grad_w


def chunked_logprobs_and_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``tokens`` and the entropy of ``softmax(hidden @ W.T / temperature)``, in chunks.

    Args:
        hidden_states: ``[..., H]`` final (normed) hidden states.
        lm_head_weight: ``[V, H]`` output embedding (``model.lm_head.weight``); no bias.
        tokens: ``[...]`` int64 token ids whose log-prob is wanted (same leading shape as hidden).
        temperature: logits are divided by it before the softmax (as in sampling).
        chunk_size: rows per chunk; peak extra memory is about ``3 * chunk_size * V * 4`` bytes (this
            module's chunks; TRL's function chunks by its own rule).
        backend: ``"auto"``, ``"rapidfire"`` or ``"trl"`` (see :func:`resolve_backend`).

    Returns:
        ``(logprobs, entropy)``, each ``[...]`` float32; both are differentiable with respect to
        ``hidden_states`` and ``lm_head_weight``.
    """
    lead = tokens.shape
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    if resolve_backend(backend, h.device) == "trl":
        logprobs, entropy = _trl_logprobs(
            h.contiguous(), lm_head_weight, tokens.reshape(-1).long(), temperature, True
        )
        return logprobs.view(lead), entropy.view(lead)
    logprobs, entropy = ChunkedLogprobsFunction.apply(
        h, lm_head_weight, tokens.reshape(-1).long(), float(temperature), int(chunk_size), True
    )
    return logprobs.view(lead), entropy.view(lead)


def chunked_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    backend: str = "auto",
) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``softmax(hidden @ W.T / temperature)``, in chunks.

    Same as ``log_softmax(hidden @ W.T / T).gather(-1, tokens)`` but never holds more than
    ``chunk_size`` rows of logits; backward recomputes each chunk.

    Args:
        hidden_states: ``[..., H]`` final (normed) hidden states.
        lm_head_weight: ``[V, H]`` output embedding; no bias.
        tokens: ``[...]`` int64 token ids.
        temperature: logits are divided by it before the softmax.
        chunk_size: rows per chunk (this module's chunks).
        backend: ``"auto"``, ``"rapidfire"`` or ``"trl"`` (see :func:`resolve_backend`).

    Returns:
        ``[...]`` float32 log-probs, differentiable.
    """
    lead = tokens.shape
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    if resolve_backend(backend, h.device) == "trl":
        logprobs, _ = _trl_logprobs(
            h.contiguous(), lm_head_weight, tokens.reshape(-1).long(), temperature, False
        )
        return logprobs.view(lead)
    logprobs, _ = ChunkedLogprobsFunction.apply(
        h, lm_head_weight, tokens.reshape(-1).long(), float(temperature), int(chunk_size), False
    )
    return logprobs.view(lead)
