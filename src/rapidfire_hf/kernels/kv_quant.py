"""An 8-bit KV cache for decoding: fp8 (e4m3) or int8 elements, one fp32 scale per (row, K/V head, token).

A cache slot's K (or V) vector of one head is stored as ``q = x / s`` in 8 bits with ``s = amax(|x|) / qmax``
over its ``D`` elements, so the largest element maps to the format's largest value and nothing saturates.
Why this layout (and not one scale per layer and head):

- a write needs no calibration and no running statistics: each new token's scale comes from its own vector
  (one ``amax`` over ``D``), so a graph-recorded step stays a pure function of its inputs;
- a read dequantizes with one multiply per element by a per-slot scale: inside the Triton flash-decoding
  kernel the scale folds into the scores (``q . k = s_k (q . k8)``) and the probabilities
  (``sum_l p_l s_v,l v8_l``), so the kernel reads 1 byte per element where a bf16 cache reads 2;
- the scales add ``4 / D`` bytes per element (3% at ``D = 128``): the cache is 0.516x of bf16's.

fp8 and int8 cost the same torch ops on a write (``amax``, a divide, a clamp and a cast; int8 rounds first,
since its cast truncates) and on a read (one cast, one multiply). fp8 keeps 3 mantissa bits relative to each
element; int8 keeps 7 bits relative to the vector's largest. Both are offered; the benchmark
(benchmarks/rollout/kv_cache.py) measures their greedy agreement with the bf16 cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    """One 8-bit element format of the cache.

    Attributes:
        name: the option's value (``"fp8"`` / ``"int8"``).
        dtype: the stored element dtype.
        qmax: the largest magnitude the format holds: a vector's ``amax`` maps to it.
        rounds: round to the nearest integer before the cast (int8: the cast truncates; fp8's cast rounds).
    """

    name: str
    dtype: torch.dtype
    qmax: float
    rounds: bool


KV_FORMATS: dict[str, KVFormat] = {
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max), False),
    "int8": KVFormat("int8", torch.int8, 127.0, True),
}
# the values of the ``kv_cache_dtype`` options: None keeps the model's dtype
KV_CACHE_DTYPES = (None, *KV_FORMATS)
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def kv_format(kv_cache_dtype: str | None) -> KVFormat | None:
    """The :class:`KVFormat` of an option value (None for None: the model's dtype).

    Raises:
        ValueError: naming the bad value and the allowed ones.
    """
    if kv_cache_dtype is None:
        return None
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return KV_FORMATS[kv_cache_dtype]


def element_bytes(kv_cache_dtype: str | None, itemsize: int, head_dim: int) -> float:
    """Bytes one cached element costs: ``itemsize`` (the model's dtype) without quantization, else one byte
    plus its share of the per-(token, head) fp32 scale."""
    if kv_format(kv_cache_dtype) is None:
        return float(itemsize)
    return 1.0 + SCALE_BYTES / head_dim


def vector_bytes(kv_cache_dtype: str | None, itemsize: int, head_dim: int) -> int:
    """Bytes one cached K (or V) vector of one head and token costs: ``head_dim`` elements of ``itemsize``
    bytes (the model's dtype), or one byte each plus its fp32 scale (the planner's KV-cache term)."""
    if kv_format(kv_cache_dtype) is None:
        return head_dim * itemsize
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` -> ``(q [..., D] in fmt.dtype, scale [...] fp32)`` with ``x ~ q * scale[..., None]``.

    An all-zero vector gets scale 1 (its elements stay 0, never 0/0).
    """
    amax = x.detach().abs().amax(dim=-1, keepdim=True).to(SCALE_DTYPE)
    scale = torch.where(amax > 0, amax / fmt.qmax, torch.ones_like(amax))
    y = x.to(SCALE_DTYPE) / scale
    if fmt.rounds:
        y = y.round()
    return y.clamp(-fmt.qmax, fmt.qmax).to(fmt.dtype), scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale[..., None]`` in ``dtype`` (8-bit values are exact in bf16, so the one rounding is the
    product's)."""
    return q.to(dtype) * scale.to(dtype)[..., None]
