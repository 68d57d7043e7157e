"""Skinny matmul in Triton for the decode step's projections: ``y = x @ W.T`` with few rows of ``x``.

At decode time a projection multiplies ``M`` = 1-64 rows (one token per sequence) by an ``nn.Linear``
weight ``W`` ``[N, K]``: about ``2 M`` flops per weight element, so the step is bound by reading ``W``
once from memory, and cuBLAS at ``M = 8`` reaches only ~40% of an H200's bandwidth (issue 31). The design
aims at reading every weight byte exactly once, from as many SMs as possible:

- **Tiles.** A program owns ``BLOCK_N`` output columns (``BLOCK_N`` rows of ``W``, contiguous in memory)
  and ``BLOCK_M`` rows of ``x`` (all of them for ``M <= 64``), and walks ``K`` in ``BLOCK_K`` steps with
  an fp32 accumulator. ``x`` is tiny and shared by every program (it stays in L2); ``W`` streams through.
- **tl.dot on a padded M, with the operands swapped.** Each step computes ``W_tile [BLOCK_N, BLOCK_K] @
  x_tile.T [BLOCK_K, BLOCK_M]``, ``BLOCK_M`` = ``M`` rounded up to a power of two, at least 16
  (``tl.dot``'s minimum) and at most 64. Putting the weight rows in the MMA's M slot keeps the large
  dimension where the tensor cores want it and the padded rows in the narrow slot; the padding costs only
  tensor-core flops, which are idle anyway at this arithmetic intensity (masked loads read no padded
  bytes). The alternative, a broadcast multiply and ``tl.sum`` over K, needs ``BLOCK_M x BLOCK_N x
  BLOCK_K`` registers per step and stops fitting beyond a few rows, while one ``tl.dot`` path serves
  every ``M`` from 1 to 64. Above 64 rows a third grid axis walks blocks of 64 rows and ``W`` is read
  once per block: correct, but there cuBLAS is the better choice.
- **Split-K, deterministic.** ``N / BLOCK_N`` programs can leave most SMs idle (a 2048 x 2048 q
  projection at ``BLOCK_N = 64`` gives 32 programs on a 132-SM H200), so ``K`` is split until there are
  about ``PROGRAMS_PER_SM`` programs per SM (:func:`num_splits`). Each split writes its fp32 partial
  ``[M, N]`` to a workspace and a second kernel adds the splits in a fixed order and casts to ``x``'s
  dtype: the result is bit-reproducible (fp32 atomics would not be). The split count is capped so the
  workspace traffic (write + read) stays under half the weight's bytes, and by the number of ``BLOCK_K``
  blocks. With one split the first kernel writes the output itself.
- **Static launch.** Block sizes, warps, stages and splits are a deterministic function of the shapes,
  the dtype and the device's SM count: no autotuning at call time, so the call can be recorded in a CUDA
  graph and traced by ``torch.compile`` (user-defined Triton kernels). The block sizes and pipeline
  stages (:func:`launch_config`) are reasoned from the H200's shared memory, not tuned.

Inputs: ``x`` ``[M, K]`` (any strides) and ``W`` ``[N, K]`` contiguous, both fp32, bf16 or fp16; the
output is ``[M, N]`` in their dtype, no bias. fp32 inputs use IEEE fp32 ``tl.dot`` (no TF32). Under
Triton's interpreter a bf16 ``tl.dot`` multiplies the raw bit patterns (triton-lang/triton#11584, not
supported there), so interpreted bf16 tiles are cast to fp32 first: the same exact products and fp32
sums as the GPU's bf16 MMA, so the CPU tests check the bf16 loads, masks, splits and the final cast,
and the GPU tests the bf16 MMA itself.

Opt-in, and it lost on the GPU (one H200, one call, ``benchmarks/kernels/results/h200/call4/``): against
``F.linear`` it is slower in 15 of the 18 projection cells (1.15-1.53x the time at the 1.1B shapes,
up to 1.93x at 7B q/k/v/o with 64 rows) and ahead by 1-4% only on the two lm_heads and the 7B down
projection at 8 rows; in the compiled decode step (fused projections) it took 1.646 ms against 1.492 ms
at batch 8 and 2.139 against 1.819 at batch 64. The engine therefore keeps cuBLAS by default
(``decode_linear="torch"``); ``"triton"`` stays for further work on the launch parameters.
Imported lazily by callers: Triton decides at import whether kernels are
compiled for the GPU or run by its interpreter (``TRITON_INTERPRET=1``, how the CPU tests run them).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rapidfire_hf.kernels.triton_flash_decode import sm_count

PROGRAMS_PER_SM = 2
MAX_BLOCK_M = 64
REDUCE_BLOCK = 1024  # outputs per program of the split-sum kernel
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what Triton decided at import: compiled for CUDA, or interpreted (then CPU tensors are fine)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _skinny_kernel(
    X, W, Y, Work,
    M, N, K, split_len,
    stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    # int64 row offsets: N x K elements of a large LM head can pass 2**31
    w_rows = W + offs_n.to(tl.int64)[:, None] * K
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    start = split * split_len
    # split_len is a multiple of BLOCK_K: only the last split has a K tail
    end = tl.minimum(start + split_len, K)
    for k0 in range(start, end, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot multiplies bit patterns: do it in fp32 (same products)
            acc = tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    # acc[n, m] is y[m, n]
    ok = n_ok[:, None] & m_ok[None, :]
    if SINGLE:
        tl.store(Y + offs_m[None, :] * N + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.store(Work + (split * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=ok)


@triton.jit
def _sum_splits_kernel(Work, Y, total, n_splits, BLOCK: tl.constexpr):
    """``Y = sum over splits of Work[split]`` (``[splits, M, N]`` fp32), in split order, cast to Y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, n_splits):
        acc += tl.load(Work + s * total + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


class LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_config(m: int, element_size: int) -> LaunchConfig:
    """Block sizes and pipeline depth for ``m`` rows of ``element_size``-byte inputs (not tuned on a GPU).

    One pipeline stage holds a ``W`` tile and an ``x`` tile: at 2 bytes, ``BLOCK_K = 128`` and
    ``BLOCK_M = 64`` that is 32 KiB, so 4 stages stay at 128 KiB of the H200's 227 KiB of shared memory
    per block; fp32 halves ``BLOCK_K`` and uses 3 stages (96 KiB).
    """
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(max(m, 1))))
    if element_size <= 2:
        return LaunchConfig(block_m, 64, 128, 4, 4)
    return LaunchConfig(block_m, 64, 64, 4, 3)


def _split_len(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """``(split_len, splits)``: ``K`` cut into ``splits`` runs of whole ``BLOCK_K`` blocks (none empty)."""
    k_blocks = max(1, triton.cdiv(k, block_k))
    splits = max(1, min(splits, k_blocks))
    split_len = triton.cdiv(k_blocks, splits) * block_k
    return split_len, triton.cdiv(k, split_len) if k > 0 else 1


def num_splits(m: int, n: int, k: int, element_size: int, sm_count: int) -> int:
    """Splits of ``K``: enough programs for about ``PROGRAMS_PER_SM`` per SM, within two caps.

    The caps: at most one split per ``BLOCK_K`` block, and workspace traffic (``splits x M x N`` fp32,
    written then read) at most half of ``W``'s ``N x K x element_size`` bytes. Returns the count the
    launch uses (whole blocks per split, so it can be below the target).
    """
    cfg = launch_config(m, element_size)
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(tiles, 1))
    by_workspace = max(1, (k * element_size) // (16 * max(m, 1)))
    return _split_len(k, min(want, by_workspace), cfg.block_k)[1]


def _check(x: torch.Tensor, weight: torch.Tensor, splits: int | None) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError(f"skinny_matmul takes tensors, got {type(x).__name__} and {type(weight).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"skinny_matmul needs a 2-D x [M, K], got shape {tuple(x.shape)} (skinny_linear takes [..., K])"
        )
    if weight.dim() != 2:
        raise ValueError(f"skinny_matmul needs a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x [M, K] has K = {x.shape[1]} but weight [N, K] has K = {weight.shape[1]} "
            f"(shapes {tuple(x.shape)} and {tuple(weight.shape)})"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"skinny_matmul runs on CUDA devices, not {x.device.type} "
            "(TRITON_INTERPRET=1 before importing it runs it slowly on the CPU)"
        )
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"skinny_matmul supports float32, bfloat16 and float16, got x {x.dtype} and weight {weight.dtype}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if not weight.is_contiguous():
        raise ValueError(
            f"skinny_matmul needs a contiguous weight [N, K] (an nn.Linear weight), got strides {weight.stride()}"
        )
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1 (or None for the default), got {splits}")


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, *, splits: int | None = None) -> torch.Tensor:
    """``x @ weight.T`` for a few rows: ``x`` ``[M, K]``, ``weight`` ``[N, K]`` -> ``[M, N]`` in ``x``'s dtype.

    fp32 accumulation, no bias. ``x`` may have any strides; ``weight`` must be contiguous. ``splits``
    overrides the split-K count (tests, benchmarks); it is clamped to the number of ``BLOCK_K`` blocks.
    The default follows :func:`num_splits`. Raises ``ValueError`` on inputs it does not take.
    """
    _check(x, weight, splits)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = launch_config(m, x.element_size())
    if splits is None:
        splits = num_splits(m, n, k, x.element_size(), sm_count(x.device))
    split_len, splits = _split_len(k, splits, cfg.block_k)
    single = splits == 1
    work = out if single else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, cfg.block_m))
    _skinny_kernel[grid](
        x, weight, out, work,
        m, n, k, split_len,
        x.stride(0), x.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SINGLE=single, IEEE=x.dtype == torch.float32, UPCAST=_INTERPRETED and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if not single:
        total = m * n
        _sum_splits_kernel[(triton.cdiv(total, REDUCE_BLOCK),)](
            work, out, total, splits, BLOCK=REDUCE_BLOCK, num_warps=4
        )
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, splits: int | None = None) -> torch.Tensor:
    """:func:`skinny_matmul` over ``x`` ``[..., K]`` -> ``[..., N]`` (leading dimensions flattened, no bias)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("skinny_linear needs x with at least one dimension [..., K]")
    lead = x.shape[:-1]
    out = skinny_matmul(x.reshape(math.prod(lead), x.shape[-1]), weight, splits=splits)
    return out.reshape(*lead, out.shape[-1])
