"""The generic decode path: any Transformers decoder-only causal LM, run by its own forward over the engine's cache.

The native path (``llama_forward.StaticLlama``) re-implements attention for the families it knows. Every other
decoder-only causal LM runs here: the model's own ``forward`` (embeddings, rotary or absolute positions,
ALiBi, sliding windows, logit soft-capping: whatever the model does) with the engine's preallocated
``[B, KV, L, D]`` tensors handed to it as a Transformers ``Cache`` (:class:`SlotCache`). The cache writes the
new keys/values at the engine's slot tensor, not at a length counter it advances itself, so a decode step is a
pure function of the engine's buffers and can be replayed from a CUDA graph (and compiled first), exactly as
the native step is; sampling and log-probs then run the engine's own sampler on the logits the forward returns.

The model sees the same inputs as under ``model.generate``: a ``[B, n]`` 0/1 attention mask over the cache
slots it reads, position ids counted from each row's first real token (``cumsum - 1``, 0 on left pads) when
its forward takes them, one token per row per decode step. Masks (causal, padding, sliding window) are built
by the model's own mask functions from that 2-D mask and the cache's sizes, so windows count cache slots as
they do in ``model.generate``.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from rapidfire_hf.models import unwrap_peft
from rapidfire_hf.rollout.sharded import ZERO3_PARTITIONED, zero3_partitioned

# attention implementations whose masks are built from the 2-D mask and the cache's sizes (flash-attention's
# varlen path reads the 2-D mask's padding itself and is not run here)
ATTENTION_IMPLS = ("sdpa", "eager")
# layer types the slot cache serves: keys/values of every position, masked by the model's own mask functions;
# others keep state it does not hold (linear attention, Mamba convolutions, layers reusing another layer's
# cache) or mask by chunk (chunked attention: untested here)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def generic_unsupported_reason(model, gathered: bool = False) -> str | None:
    """Why the generic path cannot run ``model`` (None when it can); ``gathered`` as in
    ``llama_forward.unsupported_reason``."""
    lm = unwrap_peft(model)
    cfg = getattr(lm, "config", None)
    if cfg is None or not callable(getattr(lm, "forward", None)):
        return "not a Transformers model (no config)"
    if getattr(cfg, "is_encoder_decoder", False):
        return (
            f"{cfg.model_type!r} is an encoder-decoder model; the generic path runs decoder-only causal LMs"
        )
    if not (hasattr(lm, "can_generate") and lm.can_generate()):
        return f"{type(lm).__name__} cannot generate (not a causal LM head)"
    if not gathered and zero3_partitioned(lm):
        return ZERO3_PARTITIONED
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ATTENTION_IMPLS:
        return f"attn_implementation {impl!r} is not one of {ATTENTION_IMPLS}"
    text_cfg = cfg.get_text_config(decoder=True)
    window = getattr(text_cfg, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        return f"sliding_window={window!r} is not a positive number of positions"
    types = getattr(text_cfg, "layer_types", None) or []
    other = sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
    if other:
        return f"layer types {other} are not run by the generic path (full and sliding-window attention only)"
    if not getattr(lm, "_can_compile_fullgraph", False):
        return f"{type(lm).__name__} does not support static caches in Transformers (_can_compile_fullgraph=False)"
    if _cache_argument(lm) is None:
        return f"{type(lm).__name__}.forward takes no `cache` / `past_key_values` argument"
    return None


def _cache_argument(lm) -> str | None:
    """The name the model's forward takes its cache by (Transformers 5 renames ``past_key_values`` to ``cache``)."""
    params = inspect.signature(lm.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


class SlotLayer(CacheLayerMixin):
    """One layer's keys/values in the engine's ``[B, KV, L, D]`` tensors, written where the owning
    :class:`SlotCache` says and read over its first ``n`` slots."""

    is_compileable = True
    is_sliding = False  # windows are masks over the full-length cache (slot distances), not a ring

    def __init__(self, owner: SlotCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: the engine owns the tensors."""

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new states at the owner's slots; return the first ``n`` slots of the cache."""
        where = self.owner.write_slots
        self.keys.index_copy_(2, where, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, where, value_states.to(self.values.dtype))
        n = self.owner.kv_len
        return self.keys[:, :, :n], self.values[:, :, :n]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self):
        return self.owner.query_offset

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """A Transformers ``Cache`` over the engine's per-layer tensors for one forward.

    Args:
        keys: per attention layer ``[B, KV, L, D]`` (``values`` likewise), written in place.
        write_slots: ``[Q]`` int64 cache slots of this forward's ``Q`` query tokens (a tensor: the decode
            step's slot comes from the engine's step counter, so a recorded step replays at the next slot).
        kv_len: the forward attends over slots ``[0, kv_len)``.
    """

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], write_slots: torch.Tensor, kv_len: int
    ):
        self.write_slots = write_slots
        self.query_offset = write_slots[0]  # a 0-d tensor, as Transformers' static layers report it
        self.kv_len = int(kv_len)
        super().__init__(layers=[SlotLayer(self, k, v) for k, v in zip(keys, values)])


def _probe_layers(lm, device) -> list[tuple[int, int, int, torch.dtype]]:
    """``(kv_heads, key_dim, value_dim, dtype)`` per layer, from one token through the model with a dynamic
    cache (run once per engine: key/value shapes differ between families: MQA, MLA, separate value dims)."""
    from transformers.cache_utils import DynamicCache

    was_training = lm.training
    lm.eval()
    try:
        with torch.no_grad():
            cache = DynamicCache(config=lm.config)
            ids = torch.zeros(1, 1, dtype=torch.long, device=device)
            lm(input_ids=ids, use_cache=True, **{_cache_argument(lm): cache})
    except Exception as exc:  # noqa: BLE001 - a failure of the model's own forward is said in one line
        raise ValueError(
            f"the model's own forward failed on one token ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        lm.train(was_training)
    shapes = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.ndim != 4:
            raise ValueError(
                f"layer {i} keeps no [B, heads, T, D] keys/values; the generic path cannot run this model"
            )
        shapes.append((keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype))
    return shapes


class GenericNet:
    """Prefill and one-token decode through the model's own forward, with the engine's cache passed in.

    The same interface as ``StaticLlama`` (what ``StaticEngine`` calls), so the engine's buffers, recorded
    graphs, compilation, sampler and stop handling are shared. Its "rotary table" is the position ids
    (``[1, B, L, 1]`` int64, both halves the same tensor): the model computes its own position embeddings.
    ``prefill`` and ``decode`` return float logits of the last position, which :meth:`logits` passes on.

    Args:
        model: a Transformers decoder-only causal LM (optionally PEFT-wrapped: its LoRA layers run inside the
            forward); :func:`generic_unsupported_reason` must be None.

    Raises:
        ValueError: the model cannot run on this path (the reason).
    """

    def __init__(self, model):
        reason = generic_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the generic decode path cannot run this model: {reason}")
        self.model = unwrap_peft(model)
        lm = self.model
        self.cache_arg = _cache_argument(lm)
        params = inspect.signature(lm.forward).parameters
        self.takes_positions = "position_ids" in params
        self.takes_logits_to_keep = "logits_to_keep" in params
        device = next(lm.parameters()).device
        self.layer_shapes = _probe_layers(lm, device)
        self.lm_head = lm.get_output_embeddings()  # its rows are the vocabulary the engine's buffers size by

    # ----- what StaticEngine reads besides prefill/decode ------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.layer_shapes[0][3]

    def refresh_fused(self) -> None:
        """No fused copies on this path: the model's modules run as they are."""

    def fused_weights(self) -> tuple[torch.Tensor, ...]:
        return ()

    def norm_scales(self) -> tuple[torch.Tensor, ...]:
        return ()

    def fused_bytes(self) -> int:
        return 0

    def new_cache(self, batch: int, length: int, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed per-layer ``[B, KV, L, Dk]`` keys and ``[B, KV, L, Dv]`` values in the model's cache dtype."""
        keys = [
            torch.zeros(batch, h, length, dk, dtype=dt, device=device) for h, dk, _, dt in self.layer_shapes
        ]
        values = [
            torch.zeros(batch, h, length, dv, dtype=dt, device=device) for h, _, dv, dt in self.layer_shapes
        ]
        return keys, values

    def rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[B, L]`` -> ``(ids, ids)`` with ``ids`` ``[1, B, L, 1]``: one "table" in the native
        layout ``[T, B, L, D]`` whose entries are the position ids (the model embeds positions itself)."""
        ids = positions.long()[None, ..., None]
        return ids, ids

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The forward's last-position logits ``[B, V]`` in float32."""
        return out.float()

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """The forward's last-position logits in the model's dtype (for the fused samplers)."""
        return out

    # ----- the forward ------------------------------------------------------------------------------
    def _forward(self, input_ids, mask, positions, cache: SlotCache) -> torch.Tensor:
        kwargs = {self.cache_arg: cache, "use_cache": True, "attention_mask": mask}
        if self.takes_positions:
            kwargs["position_ids"] = positions
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=input_ids, **kwargs).logits[:, -1]

    def prefill(self, input_ids, attention_mask, cos, sin, k_cache, v_cache) -> torch.Tensor:
        """Run the prompts ``[B, P]`` (left-padded), fill cache slots ``[0, P)``, return ``[B, V]`` logits.

        ``cos`` is the position table's prompt part ``[1, B, P, 1]`` (``sin`` is the same tensor).
        """
        p = input_ids.shape[1]
        slots = torch.arange(p, device=input_ids.device)
        cache = SlotCache(k_cache, v_cache, slots, p)
        return self._forward(input_ids, attention_mask.long(), cos[0, ..., 0], cache)

    def decode(
        self, tokens, slot, cos, sin, key_valid, k_cache, v_cache, kv_len: int | None = None
    ) -> torch.Tensor:
        """One token per row at cache slot ``slot`` (``[1]`` int64), attending over the valid slots of
        ``[0, kv_len)``; ``cos`` holds the tokens' position ids ``[1, B, 1]``. Returns ``[B, V]`` logits."""
        n = k_cache[0].shape[2] if kv_len is None else kv_len
        cache = SlotCache(k_cache, v_cache, slot, n)
        return self._forward(tokens[:, None], key_valid[:, :n].long(), cos[0], cache)
