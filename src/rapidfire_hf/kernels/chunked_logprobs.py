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
TRL 1.16 ships a comparable ``trl.kernels.ChunkedLogProbFunction`` (vocabulary tiles folded by a Triton
kernel, bias and soft-capping supported). It is not used here: the project supports TRL from 1.12, which
lacks it, and no GPU benchmark has compared the two yet; it is the candidate to switch to if one shows it
faster.

Under ``torch.autocast`` the projection runs in the autocast dtype in forward and in the recompute of
backward alike (backward does not inherit autocast by itself), so both see the same logits.
"""

from __future__ import annotations

import torch


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``tokens`` and the entropy of ``softmax(hidden @ W.T / temperature)``, in chunks.

    Args:
        hidden_states: ``[..., H]`` final (normed) hidden states.
        lm_head_weight: ``[V, H]`` output embedding (``model.lm_head.weight``); no bias.
        tokens: ``[...]`` int64 token ids whose log-prob is wanted (same leading shape as hidden).
        temperature: logits are divided by it before the softmax (as in sampling).
        chunk_size: rows per chunk; peak extra memory is about ``3 * chunk_size * V * 4`` bytes.

    Returns:
        ``(logprobs, entropy)``, each ``[...]`` float32; both are differentiable with respect to
        ``hidden_states`` and ``lm_head_weight``.
    """
    lead = tokens.shape
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
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
) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``softmax(hidden @ W.T / temperature)``, in chunks.

    Same as ``log_softmax(hidden @ W.T / T).gather(-1, tokens)`` but never holds more than
    ``chunk_size`` rows of logits; backward recomputes each chunk.

    Args:
        hidden_states: ``[..., H]`` final (normed) hidden states.
        lm_head_weight: ``[V, H]`` output embedding; no bias.
        tokens: ``[...]`` int64 token ids.
        temperature: logits are divided by it before the softmax.
        chunk_size: rows per chunk.

    Returns:
        ``[...]`` float32 log-probs, differentiable.
    """
    lead = tokens.shape
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    logprobs, _ = ChunkedLogprobsFunction.apply(
        h, lm_head_weight, tokens.reshape(-1).long(), float(temperature), int(chunk_size), False
    )
    return logprobs.view(lead)
