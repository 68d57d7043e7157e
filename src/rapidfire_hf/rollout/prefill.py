"""Chunked prompt prefill for the static engine (``RolloutEngine(..., prefill_chunk_rows=N)``)."""

from __future__ import annotations

import functools

import torch


def chunk_prefill(net, rows: int) -> None:
    """Make ``net.prefill`` run ``rows`` prompts at a time (``net``: a static engine's ``StaticLlama``).

    ``StaticLlama.prefill`` treats rows independently (per-row attention mask, per-row rotary tables, cache
    rows written in place), so each chunk gets row slices of the inputs and views of the cache rows; the
    cache is filled exactly as by one call and the last positions' hidden states are concatenated. The
    largest transient of a rollout (one layer's MLP over every prompt token of the batch) shrinks
    ``batch / rows`` times; per row the same arithmetic (cuBLAS may pick another kernel for fewer rows, so
    bits can differ as between batch sizes). The decode step and its recorded graphs are untouched.
    Applied once per ``net`` (a second call raises); ``prefill_rows(net)`` says the chunk size.

    Raises:
        ValueError: ``rows`` is not an int >= 1.
        RuntimeError: ``net``'s prefill is already chunked.
    """
    check_prefill_rows(rows)
    if prefill_rows(net) is not None:
        raise RuntimeError("chunk_prefill was already applied to this engine")
    original = net.prefill

    @functools.wraps(original)
    def prefill(input_ids, attention_mask, cos, sin, k_cache, v_cache, **scales):
        b = input_ids.shape[0]
        if b <= rows:
            return original(input_ids, attention_mask, cos, sin, k_cache, v_cache, **scales)
        out = []
        for start in range(0, b, rows):
            sl = slice(start, min(start + rows, b))
            out.append(
                original(
                    input_ids[sl],
                    attention_mask[sl],
                    cos[:, sl],  # [T, B, P, Dr]: rows are dim 1
                    sin[:, sl],
                    [k[sl] for k in k_cache],  # views: the chunk writes its rows of the cache in place
                    [v[sl] for v in v_cache],
                    # an 8-bit cache's per-slot scales (``scales=(k_scales, v_scales)``), rows likewise
                    **{n: tuple([t[sl] for t in ts] for ts in pair) for n, pair in scales.items() if pair},
                )
            )
        return torch.cat(out)

    net.prefill = prefill
    net._rapidfire_prefill_rows = rows


def check_prefill_rows(rows) -> None:
    """Raise ValueError unless ``rows`` (prompts per prefill chunk) is an int >= 1."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r}: prompts per prefill chunk, an int >= 1")


def prefill_rows(net) -> int | None:
    """Prompts per prefill chunk of ``net`` (``None``: not chunked)."""
    return getattr(net, "_rapidfire_prefill_rows", None)
