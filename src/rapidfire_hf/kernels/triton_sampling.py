"""Fused sampling in Triton: temperature, Gumbel-max draw and the drawn token's log-prob in one pass.

One program per row walks the vocabulary in ``BLOCK_V`` slices and keeps three running values: the
maximum and the exp-sum of the tempered scores (their log-sum-exp at the end) and the best Gumbel key
with its index and score. The ``[B, V]`` log-softmax, the Gumbel transform and the argmax of the PyTorch
path (:func:`rapidfire_hf.rollout.sampling.sample_tokens`) become one read of the logits and, when
sampling, one read of the noise. ``argmax(x / T + g)`` is the same draw as ``argmax(log_softmax(x / T) +
g)``: the two keys differ by the row's log-sum-exp, a constant.

Noise comes either from a ``[B, V]`` uniform tensor (the same stream as the PyTorch path, so both draw
the same tokens from the same generator) or from Philox inside the kernel, keyed by a per-row seed and
the step (nothing ``[B, V]`` is written or read for it): the seed of step ``t`` is ``seed_row + t *
0x5851F42D``, a fresh Philox key per step.

Top-k and top-p are not fused: :func:`fused_sample` refuses them (the engine keeps the PyTorch path).
Imported lazily (Triton decides at import whether it compiles for the GPU or interprets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _sample_kernel(
    Logits, Noise, Seeds, Step, Tok, Lp,
    stride_l, stride_n, vocab, temperature,
    MODE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # MODE 0: greedy (argmax of the raw logits); 1: noise tensor; 2: Philox noise from Seeds[row] and Step[0]
    # (a tensor, so a recorded CUDA graph replays later steps with new noise)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    best = tl.full([1], float("-inf"), tl.float32)
    best_idx = tl.zeros([1], tl.int32)
    best_x = tl.zeros([1], tl.float32)
    if MODE == 2:
        seed = tl.load(Seeds + row) + tl.load(Step) * 0x5851F42D
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + offs
        ok = cols < vocab
        x = tl.load(Logits + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        x = x.to(tl.float32)  # a Python float argument can arrive as fp64 (torch.compile)
        if MODE == 1:
            u = tl.load(Noise + row * stride_n + cols, mask=ok, other=0.5)
            key = x - tl.log(-tl.log(u))
        elif MODE == 2:
            u = tl.rand(seed, cols)
            key = x - tl.log(-tl.log(u))
        else:
            key = x
        key = tl.where(ok, key, float("-inf"))
        blk_best = tl.max(key, 0)
        blk_idx = tl.argmax(key, 0)
        blk_x = tl.sum(tl.where(offs == blk_idx, x, 0.0), 0)
        take = blk_best > best  # strict: the first maximum wins, as in torch.argmax
        best_idx = tl.where(take, v0 + blk_idx, best_idx)
        best_x = tl.where(take, blk_x, best_x)
        best = tl.where(take, blk_best, best)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    one = tl.arange(0, 1)
    tl.store(Tok + row + one, best_idx.to(tl.int64))
    tl.store(Lp + row + one, best_x - lse)


def fused_sample(
    logits: torch.Tensor,
    temperature: float,
    do_sample: bool,
    noise_uniform: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row and its log-prob under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, V]`` raw logits (any float dtype; the math is fp32), last dimension contiguous.
        temperature: divides the logits (> 0).
        do_sample: draw (Gumbel-max) or take the argmax of the raw logits.
        noise_uniform: ``[B, V]`` float32 uniform(0, 1) noise, as the PyTorch path takes it.
        seeds: instead of ``noise_uniform``, ``[B]`` int64 Philox seeds
            (:func:`rapidfire_hf.rollout.sampling.philox_seeds`); the
            noise of a row is a function of its seed, ``step`` and the token id.
        step: ``[1]`` int64 tensor holding the decode step (Philox mode only; default step 0).

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, vocab = logits.shape
    mode = 0
    if do_sample:
        if (noise_uniform is None) == (seeds is None):
            raise ValueError("sampling needs exactly one of noise_uniform or seeds")
        mode = 1 if noise_uniform is not None else 2
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    noise = noise_uniform if mode == 1 else logits
    seed_t = seeds if mode == 2 else tokens
    if mode == 2 and step is None:
        step = torch.zeros(1, dtype=torch.int64, device=logits.device)
    step_t = step if mode == 2 else tokens
    _sample_kernel[(b,)](
        logits, noise, seed_t, step_t, tokens, logprobs,
        logits.stride(0), noise.stride(0), vocab, float(temperature),
        MODE=mode, BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )  # fmt: skip
    return tokens, logprobs
