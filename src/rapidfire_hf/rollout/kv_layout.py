"""Where the static engine's K/V cache keeps each layer's slots (:class:`KVLayout`), and which of them a
prefill or a decode step attends to.

A layer's cache is ``[B, KV, L_i, D]``. A global layer (or a sliding-window layer whose window spans the whole
rollout) holds every slot of the rollout, ``L_i = P + R``. A local layer whose window is shorter keeps a ring
of ``window`` slots (``sliding_cache="ring"``): slot ``s`` is written at entry ``s mod window`` and a decode
step attends over the ring with :func:`ring_valid`'s mask; a prefill stores the prompt's last ``window`` slots
the same way (its own attention is over the whole prompt, banded by :func:`band`). Keys are cached after
their rotary embedding (absolute positions), so the order of the entries does not change attention (up to
the rounding of a sum taken in another order). ``sliding_cache="full"`` keeps every layer full-length, a
local layer's window a mask over it (the engine before the ring, kept to measure the two). An 8-bit cache
(``kernels/kv_quant.py``) stores quantized K/V with one fp32 scale per (row, K/V head, slot), in the same
ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rapidfire_hf.kernels.kv_quant import SCALE_DTYPE, KVFormat, quantize

# a local layer's cache shorter than the rollout: a ring of ``window`` slots, or the full length masked
SLIDING_CACHES = ("ring", "full")


def band(valid: torch.Tensor, query_slot, window: int | None, length: int) -> torch.Tensor:
    """``valid`` (``[..., n]`` over key slots) restricted to the sliding window ``slot > query_slot - window``
    (HF's sliding-window mask); unchanged when there is no window or it spans all ``length`` slots."""
    if window is None or window >= length:
        return valid
    keys = torch.arange(valid.shape[-1], device=valid.device)
    return valid & (keys > query_slot - window)


def ring_valid(key_valid: torch.Tensor, slot: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, size]``: which entries of a ring cache of ``size`` slots the query at cache slot ``slot`` sees.

    Entry ``j`` holds the latest slot ``<= slot`` congruent to ``j`` modulo ``size``,
    ``slot - (slot - j) mod size``: exactly the window ``(slot - size, slot]`` of HF's sliding-window mask. It
    is seen where that slot exists (``>= 0``: a ring not yet filled) and is valid in ``key_valid`` (``[B, L]``
    over all slots of the rollout: left padding, the prompt, the response so far). ``slot`` is a ``[1]``
    tensor, so a recorded or compiled step computes this at run time, one shape for every step."""
    entries = torch.arange(size, device=key_valid.device)
    held = slot - torch.remainder(slot - entries, size)
    return key_valid.index_select(1, held.clamp_min(0)) & (held >= 0)


class DecodeStep(NamedTuple):
    """Per layer, what one decode step (:meth:`KVLayout.decode_step`) reads and writes (a tuple: built inside
    a compiled or recorded step).

    Attributes:
        reads: the cache entries the step attends over (its first ``reads[i]``).
        rings: whether the layer's cache is a ring (shorter than the rollout).
        entries: ``[1]`` int64 entry the step's K/V go to: the slot, or ``slot mod window`` in a ring (one
            tensor shared by every ring of one size).
        masks: ``[B, reads[i]]`` bool, the entries the step's query sees (one tensor shared per window).
    """

    reads: list[int]
    rings: list[bool]
    entries: list[torch.Tensor]
    masks: list[torch.Tensor]


@dataclass(frozen=True)
class KVLayout:
    """The cache layout of one model's decoder layers.

    Attributes:
        windows: per layer its sliding window (None: global attention), ``models.plumbing.layer_windows``.
        sliding_cache: one of :data:`SLIDING_CACHES` (see the module's docstring).
        kv_format: the 8-bit element format (None: the model's dtype).
        n_kv: K/V heads per layer.
        head_dim: the width of one head.
    """

    windows: tuple[int | None, ...]
    sliding_cache: str
    kv_format: KVFormat | None
    n_kv: int
    head_dim: int

    def __post_init__(self):
        if self.sliding_cache not in SLIDING_CACHES:
            raise ValueError(f"sliding_cache must be one of {SLIDING_CACHES}, got {self.sliding_cache!r}")

    def cache_lengths(self, length: int) -> list[int]:
        """Per layer: the cache slots of a rollout of ``length`` (prompt + response) slots: ``length``, or the
        window of a local layer whose window is shorter (its ring; all ``length`` with ``sliding_cache="full"``)."""
        if self.sliding_cache == "full":
            return [length] * len(self.windows)
        return [w if w is not None and w < length else length for w in self.windows]

    def new_cache(
        self, batch: int, length: int, device, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed ``(k, v)`` caches for a rollout of ``length`` slots: one ``[B, KV, L_i, D]`` tensor per layer,
        in ``dtype`` (the model's; the 8-bit format's where set), ``L_i`` from :meth:`cache_lengths`.

        One tensor per layer rather than one stacked tensor: under ``torch.compile`` an in-place write into
        a view of a graph input can be functionalised into a scatter over the whole base tensor.
        """
        dtype = dtype if self.kv_format is None else self.kv_format.dtype

        def make():
            return [
                torch.zeros((batch, self.n_kv, n, self.head_dim), dtype=dtype, device=device)
                for n in self.cache_lengths(length)
            ]

        return make(), make()

    def new_cache_scales(self, batch: int, length: int, device) -> tuple[list, list] | None:
        """An 8-bit cache's ``(k_scales, v_scales)``: one ``[B, KV, L_i]`` fp32 tensor per layer each (ones,
        so an unwritten slot dequantizes to the zero it holds; ``L_i`` as :meth:`new_cache`'s); None for a
        cache in the model's dtype."""
        if self.kv_format is None:
            return None

        def make():
            return [
                torch.ones((batch, self.n_kv, n), dtype=SCALE_DTYPE, device=device)
                for n in self.cache_lengths(length)
            ]

        return make(), make()

    def split_scales(self, scales) -> tuple[list | None, list | None]:
        """``(k_scales, v_scales)`` of a prefill or decode call: given exactly when the cache is 8-bit."""
        if (scales is None) != (self.kv_format is None):
            want = "no scales" if self.kv_format is None else f"the {self.kv_format.name} cache's scales"
            raise ValueError(f"this forward's cache needs {want} (scales= of prefill / decode)")
        return (None, None) if scales is None else scales

    def write(self, cache, scales, i: int, x: torch.Tensor, entries=None) -> None:
        """Store ``x`` ``[B, KV, n, D]`` into layer ``i``'s cache at entries ``[0, n)`` (``entries`` None) or at
        ``entries`` (``[n]`` int64), quantized for an 8-bit cache (its scales into ``scales[i]``)."""
        s = None
        if self.kv_format is not None:
            x, s = quantize(x, self.kv_format)
        if entries is None:
            cache[i][:, :, : x.shape[2]] = x
            if s is not None:
                scales[i][:, :, : x.shape[2]] = s
            return
        if s is None or cache[i].dtype == torch.int8:
            cache[i].index_copy_(2, entries, x)
        else:
            # float8 as bytes: torch has no index_copy_ kernel for float8 (a same-size dtype view copies the
            # same bits). Not int8: on one H100 the compiled 7B decode step that wrote an int8 cache through
            # this view took 35.95 ms against 13.44 ms over bf16 at batch 128, recorded (not compiled) 17.33
            # vs 16.43 (benchmarks/rollout/results/h100/kv_cache_2026-12-07)
            cache[i].view(torch.uint8).index_copy_(2, entries, x.view(torch.uint8))
        if s is not None:
            scales[i].index_copy_(2, entries, s)

    def write_prompt(self, cache, scales, i: int, x: torch.Tensor) -> None:
        """Store the prompt's ``x`` ``[B, KV, P, D]`` into layer ``i``'s cache: at slots ``[0, P)``, or, in a
        ring shorter than the prompt, its last ``window`` slots at entries ``slot mod window``."""
        size, p = cache[i].shape[2], x.shape[2]
        if p <= size:
            self.write(cache, scales, i, x)
            return
        if self.windows[i] != size:
            raise ValueError(f"layer {i}'s cache holds {size} slots, fewer than the prompt's {p}")
        entries = torch.arange(p - size, p, device=x.device) % size
        self.write(cache, scales, i, x[:, :, p - size :].contiguous(), entries)

    def prompt_masks(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Per layer the ``[B, P, P]`` bool mask of a prefill over left-padded prompts (``attention_mask``
        ``[B, P]``, 1 for real tokens): causal, banded by the layer's window, real keys only; a pad query sees
        itself, so its (unused) output is finite and never NaN-poisons the cache. One tensor per window."""
        p, device = attention_mask.shape[1], attention_mask.device
        key_ok = attention_mask.bool()
        causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()
        eye = torch.eye(p, dtype=torch.bool, device=device)
        rows = torch.arange(p, device=device)[:, None]
        masks = {w: (band(causal, rows, w, p)[None] & key_ok[:, None, :]) | eye for w in set(self.windows)}
        return [masks[w] for w in self.windows]

    def decode_step(
        self, k_cache, key_valid: torch.Tensor, slot: torch.Tensor, kv_len: int | None
    ) -> DecodeStep:
        """What a decode step at cache slot ``slot`` (``[1]`` int64) reads and writes in each layer of
        ``k_cache`` (:meth:`new_cache`'s): ``key_valid`` ``[B, L]`` over all ``L`` slots of the rollout, True
        for slots the query may see (including ``slot``); ``kv_len`` bounds the slots read (a ring: its first
        ``min(kv_len, L_i)`` entries, all it has written by then; None: all). One remainder per ring size and
        one mask per window (shared by every layer of that size), whatever the number of layers."""
        length = key_valid.shape[1]
        n = length if kv_len is None else kv_len
        valid = key_valid[:, :n]
        reads, keys, where, entry = [], [], [], {}
        for cache, window in zip(k_cache, self.windows):
            size = cache.shape[2]
            ring = size < length
            reads.append(min(n, size) if ring else n)
            keys.append(("ring", size) if ring else ("band", window))
            if ring and size not in entry:
                entry[size] = torch.remainder(slot, size)
            where.append(entry[size] if ring else slot)
        masks = {}
        for kind, arg in set(keys):
            if kind == "ring":
                masks[kind, arg] = ring_valid(key_valid, slot, arg)[:, : min(n, arg)]
            else:
                masks[kind, arg] = band(valid, slot, arg, length)
        return DecodeStep(reads, [k[0] == "ring" for k in keys], where, [masks[k] for k in keys])
