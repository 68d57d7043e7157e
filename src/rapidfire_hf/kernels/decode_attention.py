"""Grouped-query attention for one decode token against a static KV cache, reading each K/V head once.

HF's eager and SDPA paths expand K/V from ``kv_heads`` to ``heads`` over the whole cache on every step
(``repeat_kv``); on the 1.1B Llama shape at batch 256 that copy is 74% of the decode step's GPU time
(benchmarks/rollout/README.md). Here the ``group = heads // kv_heads`` query heads that share a K/V head are laid out as
the rows of one attention problem over that head: ``[B, kv, group, D]`` against ``[B, kv, L, D]``.

Three implementations of the same math:

- ``"sdpa"`` (default): ``scaled_dot_product_attention`` with the group as the query-length axis (no
  causal mask among the group's rows; a ``[B, 1, 1, L]`` key mask). On CUDA this is a fused kernel
  (memory-efficient / cuDNN attention), so the ``[B, kv, group, L]`` scores never reach memory.
- ``"matmul"``: two batched matmuls with an fp32 softmax in between, as HF's eager attention does.
  Unfused: at group 8 the fp32 scores passes move more bytes than the K/V reads themselves.
- ``"triton"``: the project's flash-decoding kernel (``kernels/triton_flash_decode.py``): the group's query
  heads as one tile per K/V head, the cache length split across programs so a small batch still fills the
  GPU, fp32 online softmax, and (given ``kv_end``) no read of the slots past the current step, which a
  recorded step with SDPA reads every time. Needs Triton and a CUDA device (or ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rapidfire_hf.kernels.kv_quant import dequantize

IMPLS = ("sdpa", "matmul", "triton")
# "auto": the Triton kernel where it runs compiled (CUDA, Triton, compute capability 8.0 or later for its
# bf16 dot products), SDPA elsewhere. One H200 at the response's mean cache length (320 of 512 slots,
# benchmarks/kernels/results/h200/call5): one layer's attention 1.3-2.7x faster than SDPA at batch 8-256
# (7B batch 8: 19.6 against 26.2 us), the compiled decode step 1.33x at 1.1B batch 256, 1.24x at 7B batch
# 256, 0.99-1.01x at batch 8; PPO updates 1.05x (7B full, batch 256), 1.06x (7B LoRA, 256), 1.02x / 1.00x
# (1.1B, batch 8 / 32), each against SDPA in the same call.
AUTO = "auto"


def resolve_impl(impl: str, device: torch.device, recorded: bool = True) -> str:
    """The implementation ``impl`` names on ``device``: ``"auto"`` resolves as :data:`AUTO`'s comment says;
    any other name is returned as given (checked against :data:`IMPLS`). ``recorded=False`` (an eager decode
    step): ``"auto"`` is SDPA, since each Triton launch from Python costs ~20-60 us of host time per layer
    (benchmarks/kernels/results/h200_host_launch), more than the kernel saves."""
    if impl != AUTO:
        if impl not in IMPLS:
            raise ValueError(f"decode attention must be one of {(*IMPLS, AUTO)}, got {impl!r}")
        return impl
    device = torch.device(device)
    if not recorded or device.type != "cuda" or triton_unavailable_reason(device) is not None:
        return "sdpa"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "triton" if torch.cuda.get_device_capability(index) >= (8, 0) else "sdpa"


def gqa_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    impl: str = "sdpa",
    kv_end: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over a (masked) static cache, GQA-aware.

    Args:
        q: ``[B, KV, G, D]`` queries; head ``h`` of the model is ``(h // G, h % G)``, the order of HF's
            ``repeat_kv``.
        k_cache: ``[B, KV, L, D]`` cached keys (rotary already applied); may be a length-slice view.
        v_cache: ``[B, KV, L, D]`` cached values.
        key_valid: ``[B, L]`` bool, True where a cache slot holds a real token this query may see.
        scale: softmax scale, usually ``D ** -0.5``.
        impl: "sdpa" (fused where the device has a kernel), "matmul" or "triton".
        kv_end: optional one-element integer tensor: no valid slot lies at or past it. Only ``"triton"``
            uses it, to read no slot there (a run-time bound inside a recorded or compiled step); the others
            read the whole cache and mask. The result is the same either way.
        k_scale: ``[B, KV, L]`` fp32 per-slot scales of an 8-bit cache (``kernels/kv_quant.py``; ``v_scale``
            likewise; both or neither). ``"triton"`` dequantizes inside the kernel (it reads the 8-bit cache);
            the others dequantize the ``L`` slots given into ``q``'s dtype first.

    Returns:
        ``[B, KV, G, D]`` attention output in ``q.dtype``.
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError("an 8-bit cache needs both k_scale and v_scale")
    if impl == "triton":
        return _triton_flash_decode()(
            q, k_cache, v_cache, key_valid, scale, kv_end=kv_end, k_scale=k_scale, v_scale=v_scale
        )
    if k_scale is not None:
        k_cache, v_cache = dequantize(k_cache, k_scale, q.dtype), dequantize(v_cache, v_scale, q.dtype)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(
            q, k_cache, v_cache, attn_mask=key_valid[:, None, None, :], scale=scale
        )
    if impl != "matmul":
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    scores = torch.matmul(q, k_cache.transpose(-1, -2)).float() * scale  # [B, KV, G, L]
    scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    # fp32 softmax then cast back, as HF's eager attention does
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
    return torch.matmul(probs, v_cache)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why ``impl="triton"`` cannot run on ``device`` (None when it can)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it ships with the CUDA builds of torch)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels run on CUDA devices, not {device.type} (TRITON_INTERPRET=1 runs them slowly on the CPU)"
    return None


def _triton_flash_decode():
    from rapidfire_hf.kernels.triton_flash_decode import flash_decode

    return flash_decode
