"""GQA flash-decoding in Triton: one query token per row against a static KV cache, split over its length.

The grid is ``(batch x kv_heads, splits)``. Each program loads the ``group`` query heads that share one
K/V head as the rows of a ``[G, D]`` tile, so every K/V slot is read once for its whole group, and walks
its share of the cache in ``BLOCK_N`` slots with an online softmax in fp32 (``key_valid`` masks slots per
row). At small batches ``batch x kv_heads`` programs would leave most of the GPU idle (8 x 4 = 32 on a
132-SM H200), so the cache length is split until there are about two programs per SM; a second kernel
merges the splits' partial sums with their log-sum-exp weights. With one split the first kernel writes
the normalised output itself.

``kv_end`` (a device tensor, so a recorded or compiled step reads it at run time) bounds the slots read:
a decode step at slot ``s`` of a static cache needs only ``[0, s]``, while the shapes (and so the grid)
stay those of the whole cache. Programs whose split starts past the bound exit at once; the others stop
there. Slots past it are masked out by ``key_valid`` anyway, so in exact arithmetic nothing changes: a
fully masked block leaves the online softmax unchanged (``alpha = 1``, ``p = 0``). Triton's interpreter
gives bit-identical results with and without the bound; on a GPU the two are separate compilations
(``HAS_END``), held to one bf16 rounding of each other by the GPU test. SDPA in a
recorded step has no such bound and reads every slot: at 128 + 384 tokens the average step needs 320 of
512 slots.

Imported lazily by :func:`rapidfire_hf.kernels.decode_attention.gqa_decode_attention` (``impl="triton"``):
Triton decides at import whether kernels are compiled for the GPU or run by its interpreter
(``TRITON_INTERPRET=1``, how the CPU tests run them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # cache slots per inner step
PROGRAMS_PER_SM = 2


class Launch(NamedTuple):
    """How the partial kernel is launched: cache slots per inner step, warps per program, software-pipeline
    stages of the inner loop (Triton's ``num_warps`` / ``num_stages``)."""

    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def parse(cls, text: str) -> Launch:
        """``"128x8x3"`` -> ``Launch(128, 8, 3)``; anything else is refused by name."""
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"launch {text!r}: expected BLOCKxWARPSxSTAGES, e.g. 64x4x3")
        launch = cls(*(int(p) for p in parts))
        launch.check()
        return launch

    def check(self) -> None:
        power = [v for v in (self.block_n, self.num_warps) if v < 1 or v & (v - 1)]
        if power or not 16 <= self.block_n <= 512 or self.num_warps > 16 or not 1 <= self.num_stages <= 8:
            raise ValueError(
                f"launch {self}: block_n a power of two in 16..512, num_warps a power of two up to 16, "
                "num_stages 1..8"
            )


DEFAULT_LAUNCH = Launch()


@triton.jit
def _store_out(Out, base, stride_og, offs_g, offs_d, out, g_ok, d_ok):
    """The ``[G, D]`` output tile of one (row, K/V head), in the output's dtype."""
    tl.store(
        Out + base + offs_g[:, None] * stride_og + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _partial_kernel(
    Q, K, V, Valid, End, Out, Acc, Mx, Sums, KScale, VScale,
    stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_valid,
    stride_ob, stride_oh, stride_og,
    stride_sb, stride_sh,
    n_kv, group, kv_len, split_len, n_splits, scale,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    SINGLE: tl.constexpr, IEEE: tl.constexpr, HAS_END: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_kv
    h = bh % n_kv
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK)
    g_ok = offs_g < group
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    # an 8-bit cache: one fp32 scale per slot of this (row, head), the same layout for K and V
    s_off = b * stride_sb + h * stride_sh
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    if HAS_END:  # the slots any row can see this step (run-time bound; the grid covers the whole cache)
        end = tl.minimum(end, tl.load(End).to(tl.int32))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK):
        cols = n0 + offs_n
        c_ok = cols < end
        ok = c_ok & (tl.load(Valid + b * stride_valid + cols, mask=c_ok, other=0) != 0)
        k = tl.load(
            k_base + cols[:, None] * stride_kl + offs_d[None, :],
            mask=c_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if QUANT:  # 8-bit values are exact in q's dtype; the slot's scale multiplies its score
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if QUANT:
            s = s * tl.load(KScale + s_off + cols, mask=c_ok, other=0.0)[None, :]
        # under torch.compile a Python float argument arrives as fp64: keep the loop's values fp32
        s = tl.where(ok[None, :], (s * scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no valid slot yet keeps m = -inf; shift by 0 there so exp() gives 0, never NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vl + offs_d[None, :],
            mask=c_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        pw = p
        if QUANT:  # the sum of p above is unscaled; the slot's V scale weighs its probability
            pw = p * tl.load(VScale + s_off + cols, mask=c_ok, other=0.0)[None, :]
            v = v.to(q.dtype)
        if IEEE:
            pv = tl.dot(pw, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pw.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SINGLE:
        _store_out(
            Out, b * stride_ob + h * stride_oh, stride_og, offs_g, offs_d, acc / l_i[:, None], g_ok, d_ok
        )
    else:
        row = (bh * n_splits + split) * BLOCK_G
        tl.store(Acc + (row + offs_g[:, None]) * BLOCK_D + offs_d[None, :], acc)
        tl.store(Mx + row + offs_g, m_i)
        tl.store(Sums + row + offs_g, l_i)


@triton.jit
def _merge_kernel(
    Acc, Mx, Sums, Out,
    stride_ob, stride_oh, stride_og,
    n_kv, group, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // n_kv
    h = bh % n_kv
    offs_s = tl.arange(0, BLOCK_S)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    rows = (bh * n_splits + offs_s[:, None]) * BLOCK_G + offs_g[None, :]  # [S, G]
    m = tl.load(Mx + rows, mask=s_ok[:, None], other=float("-inf"))
    sums = tl.load(Sums + rows, mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    m_shift = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_shift[None, :])  # [S, G]; a split with no valid slot weighs 0
    denom = tl.sum(w * sums, 0)
    acc = tl.load(
        Acc + rows[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=s_ok[:, None, None], other=0.0
    )
    out = tl.sum(w[:, :, None] * acc, 0) / denom[:, None]
    _store_out(
        Out, b * stride_ob + h * stride_oh, stride_og, offs_g, offs_d, out, offs_g < group, offs_d < HEAD_DIM
    )


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (asked once per device: this runs for every layer of an eager decode step)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter: a few splits, so the merge path runs in the CPU tests too


def num_splits(batch: int, n_kv: int, kv_len: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Splits of the cache length: about ``PROGRAMS_PER_SM`` programs per SM, at most one per ``block_n`` slots."""
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count(device), batch * n_kv)
    return max(1, min(want, triton.cdiv(kv_len, block_n)))


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    splits: int | None = None,
    kv_end: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """``[B, KV, G, D]`` queries over ``[B, KV, L, D]`` caches (``key_valid`` ``[B, L]``) -> ``[B, KV, G, D]``.

    ``splits`` overrides the split count (tests); the default follows :func:`num_splits`. The caches may be
    length-slice views of larger caches; their last dimension must be contiguous. ``kv_end``: an integer
    tensor of one element on the caches' device, no slot at or past it is read (every row's valid slots
    must lie below it; the result then equals ``kv_end=None``'s up to the rounding of another compilation).
    ``k_scale`` / ``v_scale``: ``[B, KV, L]`` fp32 per-slot scales of an 8-bit (fp8 / int8) cache
    (``kernels/kv_quant.py``), applied inside the kernel, which reads one byte per cached element.
    ``launch``: the partial kernel's :class:`Launch` (None: :data:`DEFAULT_LAUNCH`); the same arithmetic in
    another order (blocks of another size), so results agree to rounding, not bits.
    """
    if launch is None:
        launch = DEFAULT_LAUNCH
    else:  # a launch given here (the default is valid by construction: not checked again every call)
        launch.check()
    b, n_kv, group, d = q.shape
    kv_len = k_cache.shape[2]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("flash_decode needs the caches' head dimension contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    quant = k_scale is not None
    if quant != (v_scale is not None) or (
        quant and (k_scale.shape != k_cache.shape[:3] or v_scale.stride() != k_scale.stride()
                   or k_scale.stride(-1) != 1 or k_scale.dtype != torch.float32)
    ):  # fmt: skip
        raise ValueError(
            "an 8-bit cache needs k_scale and v_scale both, fp32 [B, KV, L] with the caches' first three "
            f"dimensions {tuple(k_cache.shape[:3])} and the same strides, the last contiguous"
        )
    if k_cache.dtype != q.dtype and not quant:
        raise ValueError(f"a {k_cache.dtype} cache with {q.dtype} queries needs k_scale / v_scale")
    valid = key_valid  # bool is loaded as int1 (a dtype view here would break torch.compile: no bool iinfo)
    out = torch.empty_like(q)
    block_n = launch.block_n
    n_splits = splits or num_splits(b, n_kv, kv_len, q.device, block_n)
    split_len = triton.cdiv(triton.cdiv(kv_len, n_splits), block_n) * block_n
    n_splits = triton.cdiv(kv_len, split_len)
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    ieee = q.dtype == torch.float32
    if n_splits > 1:
        acc = torch.empty(b * n_kv * n_splits * block_g * block_d, dtype=torch.float32, device=q.device)
        mx = torch.empty(b * n_kv * n_splits * block_g, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(mx)
    else:
        acc = mx = sums = out  # unused by the single-split path
    if kv_end is not None and (
        kv_end.numel() != 1 or kv_end.dtype.is_floating_point or kv_end.dtype == torch.bool
        or kv_end.device != k_cache.device
    ):  # fmt: skip
        raise ValueError(
            f"kv_end must hold one integer slot count on the caches' device ({k_cache.device}), got "
            f"{kv_end.dtype} of shape {tuple(kv_end.shape)} on {kv_end.device}"
        )
    end = kv_end if kv_end is not None else valid  # unused when HAS_END is off
    ks, vs = (k_scale, v_scale) if quant else (mx, mx)  # unused when QUANT is off
    _partial_kernel[(b * n_kv, n_splits)](
        q, k_cache, v_cache, valid, end, out, acc, mx, sums, ks, vs,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        valid.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        n_kv, group, kv_len, split_len, n_splits, scale,
        HEAD_DIM=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK=block_n, SINGLE=n_splits == 1, IEEE=ieee,
        HAS_END=kv_end is not None, QUANT=quant, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if n_splits > 1:
        _merge_kernel[(b * n_kv,)](
            acc, mx, sums, out,
            out.stride(0), out.stride(1), out.stride(2),
            n_kv, group, n_splits,
            HEAD_DIM=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(n_splits),
        )  # fmt: skip
    return out
