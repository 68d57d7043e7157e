"""A Llama-family forward pass over a static KV cache, run on the HF modules' own weights.

Only attention is re-implemented (so no HF cache object or mask builder is in the loop); embeddings,
norms, projections and MLPs are the model's modules, called directly, so PEFT LoRA layers wrapped
around ``q_proj`` etc. keep working and generation always sees the current training weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rapidfire_hf.kernels import gqa_decode_attention
from rapidfire_hf.kernels.decode_attention import IMPLS
from rapidfire_hf.models import unwrap_peft

DECODE_LINEARS = ("torch", "triton")

# model_type -> per-architecture switches; everything else about these models is shared
SUPPORTED = {
    "llama": {"qk_norm": False},
    "mistral": {"qk_norm": False},
    "qwen2": {"qk_norm": False},
    "qwen3": {"qk_norm": True},
}


def unsupported_reason(model) -> str | None:
    """Why the static engine cannot run ``model`` (None when it can)."""
    lm = unwrap_peft(model)
    cfg = getattr(lm, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED:
        return f"model_type {model_type!r} is not one of {sorted(SUPPORTED)}"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers are not supported"
    if any(hasattr(p, "ds_id") for p in lm.parameters()):
        return "DeepSpeed ZeRO-3 partitions the weights; generate through model.generate"
    body = getattr(lm, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "the model has no `.model.layers` / `.model.rotary_emb`"
    if getattr(body.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return "length-dependent rotary scaling (dynamic/longrope) is not supported"
    return None


def _fusable(layer, lora: bool = False) -> bool:
    """Whether a decoder layer's q/k/v and gate/up projections are plain bias-free ``nn.Linear`` of one dtype
    (with ``lora``: or PEFT LoRA ``Linear`` layers over such a base; quantized linears and biased projections
    keep their module calls)."""
    attn, mlp = layer.self_attn, layer.mlp
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    projs += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    ok = (lambda m: _plain(m) or _lora_linear(m)) if lora else _plain
    return (
        all(ok(m) for m in projs)
        and len({_base(m).weight.dtype for m in projs}) == 1
        and callable(getattr(mlp, "act_fn", None))
        and isinstance(getattr(mlp, "down_proj", None), nn.Module)
    )


def _lora_linear(module) -> bool:
    """A PEFT LoRA ``Linear`` over a plain bias-free ``nn.Linear`` (any adapter state: see :func:`_lora_term`)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    # exactly PEFT's dense LoRA Linear: its quantized subclasses and siblings compute their base otherwise
    return type(module) is LoraLinear and _plain(module.base_layer)


def _base(module) -> nn.Linear:
    return module.base_layer if _lora_linear(module) else module


# what _lora_term returns for a LoRA layer whose state the fused decode does not reproduce
UNSUPPORTED = "unsupported"


def _lora_term(module):
    """The low-rank term a projection adds to its base output now, as ``(A, B, scaling)``; None when it adds
    none (a plain linear; adapters disabled and not merged; merged, so the base weight holds the term); or
    :data:`UNSUPPORTED` where its forward does more than one vanilla adapter's ``B(A(x)) * scaling`` (several
    active adapters, a variant such as DoRA, a bias on A or B, dropout that acts, disabled while merged)."""
    if not _lora_linear(module):
        return None
    merged = bool(getattr(module, "merged", False))
    if module.disable_adapters:
        return UNSUPPORTED if merged else None  # PEFT unmerges on such a forward
    if merged:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A.keys()]
    if not active:
        return None
    if len(active) > 1:
        return UNSUPPORTED
    name = active[0]
    a, b, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
    inert = isinstance(dropout, nn.Identity) or (
        isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)
    )
    if (
        name in getattr(module, "lora_variant", {})
        or not (_plain(a) and _plain(b))
        or not inert
        or not getattr(module, "cast_input_dtype_enabled", True)
    ):
        return UNSUPPORTED
    return a.weight, b.weight, module.scaling[name]


def _lora_into(out, terms: list, sizes: list[int]):
    """``(A_cat, B_blk)`` for one fused projection group: the groups' A stacked ``[R, H]`` and their
    ``B * scaling`` placed block-diagonally ``[sum(sizes), R]`` (zero rows for projections without a term),
    written into ``out`` when its shapes still fit (graph-recorded addresses stay valid); None without terms."""
    if all(t is None for t in terms):
        return None
    a_parts = [t[0] for t in terms if t is not None]
    ranks = [a.shape[0] for a in a_parts]
    first = a_parts[0]
    a_cat = _concat_into(None if out is None else out[0], tuple(a_parts))
    shape = (sum(sizes), sum(ranks))
    b_blk = out[1] if out is not None else None
    if b_blk is None or b_blk.shape != shape or b_blk.dtype != first.dtype or b_blk.device != first.device:
        b_blk = torch.zeros(shape, dtype=first.dtype, device=first.device)
    else:
        b_blk.zero_()
    row = col = 0
    for term, size in zip(terms, sizes):
        if term is not None:
            r = term[0].shape[0]
            b_blk[row : row + size, col : col + r].copy_(term[1]).mul_(term[2])  # B * scaling, in place
            col += r
        row += size
    return a_cat, b_blk


def fused_projection_bytes(model, lora: bool = False) -> int:
    """Bytes of the concatenated q/k/v and gate/up copies that ``fuse_projections=True`` allocates for
    ``model`` at its first generation and keeps (the layers :class:`StaticLlama` fuses, with ``lora`` those
    with LoRA projections too; others take none). LoRA's stacked factors are left out (rank x width)."""
    lm = unwrap_peft(model)
    total = 0
    for layer in list(lm.model.layers[: lm.config.num_hidden_layers]):
        if _fusable(layer, lora):
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                w = _base(m).weight
                total += w.numel() * w.element_size()
    return total


def _plain(module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def _plain_outputs(layer) -> bool:
    """Whether a decoder layer's o and down projections are plain bias-free ``nn.Linear``."""
    return _plain(getattr(layer.self_attn, "o_proj", None)) and _plain(getattr(layer.mlp, "down_proj", None))


def _concat_into(out: torch.Tensor | None, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``weights`` stacked along dim 0 into ``out`` (reallocated when it no longer fits)."""
    rows = sum(w.shape[0] for w in weights)
    first = weights[0]
    if (
        out is None
        or out.shape != (rows, first.shape[1])
        or out.dtype != first.dtype
        or out.device != first.device
    ):
        return torch.cat([w.detach() for w in weights])
    start = 0
    for w in weights:
        out[start : start + w.shape[0]].copy_(w)
        start += w.shape[0]
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class StaticLlama:
    """Prefill and one-token decode for a Llama-family model, with the cache passed in explicitly.

    Args:
        model: an HF ``LlamaForCausalLM`` (or Mistral/Qwen2/Qwen3), possibly wrapped by PEFT.
        attention: decode attention implementation, see :func:`rapidfire_hf.kernels.gqa_decode_attention`.
        fuse_projections: decode each layer's q/k/v projections as one matmul and its gate/up projections as
            another, from concatenated copies of their weights (:meth:`refresh_fused` copies the current
            weights in before each generation). At decode batch sizes every projection reads its whole
            weight for a few rows, so fewer, larger matmuls waste less of each weight read and launch (the
            profile in benchmarks/kernels: the weight GEMMs are ~1.1 of 1.78 ms per step at 1.1B batch 8,
            against a 0.45 ms floor for the whole step). Costs a second copy of those weights (1.2 GB at
            1.1B). Layers whose projections are not plain bias-free ``nn.Linear`` (PEFT LoRA, quantized,
            biased) keep the module calls. On one H200 (benchmarks/kernels, third call) the step is 1.21x faster at
            1.1B batch 8, 1.18x at batch 64 and 1.10x at 7B batch 8; PPO updates 1.09x at batch 8 and 1.00x at
            batch 32 against the module projections (eighth and ninth calls). ``PPOTrainer`` fuses where its plan
            has room for the copies (``rollout_decode_fuse_projections="auto"``).
        linear: the matmul of the fused layers' decode projections (q/k/v, o, gate/up, down): ``"torch"``
            (``F.linear``) or ``"triton"`` (:func:`rapidfire_hf.kernels.triton_skinny_matmul.skinny_linear`,
            built to read each weight once at close to the memory bandwidth for a few rows). Needs
            ``fuse_projections``. Opt-in: not yet measured on a GPU (``benchmarks/kernels`` matmul rows,
            ``benchmarks/rollout`` system ``ours_compile+fuse_skinny``).
        fuse_lora: with ``fuse_projections``, fuse layers whose projections are PEFT LoRA layers too: the base
            weights concatenated as above, and per group one matmul by the stacked ``A`` factors and one by the
            block-diagonal ``B * scaling`` (three matmuls for q/k/v where the module calls make nine). A
            generation whose adapter state the fused step does not reproduce (:func:`_lora_term`) runs those
            layers' module calls. Opt-in: not yet measured on a GPU.
    """

    def __init__(
        self,
        model,
        attention: str = "sdpa",
        fuse_projections: bool = False,
        linear: str = "torch",
        fuse_lora: bool = False,
    ):
        if linear not in DECODE_LINEARS:
            raise ValueError(f"linear must be one of {DECODE_LINEARS}, got {linear!r}")
        if linear != "torch" and not fuse_projections:
            raise ValueError(
                f"linear={linear!r} runs the fused decode projections only: set fuse_projections=True "
                "(decode_fuse_projections=True on the rollout engine)"
            )
        if fuse_lora and not fuse_projections:
            raise ValueError(
                "fuse_lora=True fuses LoRA layers into the fused decode projections: set fuse_projections=True "
                "too (decode_fuse_projections=True on the rollout engine)"
            )
        self._linear = F.linear
        if linear == "triton":
            from rapidfire_hf.kernels.triton_skinny_matmul import skinny_linear

            self._linear = skinny_linear
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static rollout engine cannot run this model: {reason}")
        if attention not in IMPLS:
            raise ValueError(f"attention must be one of {IMPLS}, got {attention!r}")
        self.attention = attention
        lm = unwrap_peft(model)
        cfg = lm.config
        self.body = lm.model
        self.lm_head = lm.get_output_embeddings()
        self.layers = list(self.body.layers[: cfg.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.group = self.n_heads // self.n_kv
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.qk_norm = SUPPORTED[cfg.model_type]["qk_norm"]
        self.window = (
            getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        )
        self.fused = [fuse_projections and _fusable(layer, fuse_lora) for layer in self.layers]
        # per generation (refresh_fused): whether a fused layer runs fused now (its LoRA state reproducible)
        self.fused_now = list(self.fused)
        # with linear="triton", a fused layer's o / down projections go through it too where they are plain
        # linears; else (and with linear="torch") their module calls: a LoRA o_proj keeps its adapter
        self._out_linear = [
            self._linear if linear != "torch" and fused and _plain_outputs(layer) else None
            for layer, fused in zip(self.layers, self.fused)
        ]
        self._qkv_w: list[torch.Tensor | None] = [None] * len(self.layers)  # [(Hq + 2 KV) D, H]
        self._gu_w: list[torch.Tensor | None] = [None] * len(self.layers)  # [2 I, H]
        # LoRA factors of a fused group: (A stacked [R, H], B * scaling block-diagonal [out, R]) or None
        self._qkv_lora: list[tuple | None] = [None] * len(self.layers)
        self._gu_lora: list[tuple | None] = [None] * len(self.layers)

    def refresh_fused(self) -> None:
        """Copy the layers' current projection weights (and LoRA factors, as the adapters stand now) into the
        concatenated ones (allocated on first use or when a weight's shape, dtype or device changed; in place
        otherwise, so recorded graphs stay valid)."""
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                if not self.fused[i]:
                    continue
                attn, mlp = layer.self_attn, layer.mlp
                qkv, gu = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
                terms = [_lora_term(m) for m in (*qkv, *gu)]
                self.fused_now[i] = UNSUPPORTED not in terms
                if not self.fused_now[i]:
                    continue  # this generation runs the layer's module calls
                self._qkv_w[i] = _concat_into(self._qkv_w[i], tuple(_base(m).weight for m in qkv))
                self._gu_w[i] = _concat_into(self._gu_w[i], tuple(_base(m).weight for m in gu))
                self._qkv_lora[i] = _lora_into(
                    self._qkv_lora[i], terms[:3], [_base(m).weight.shape[0] for m in qkv]
                )
                self._gu_lora[i] = _lora_into(
                    self._gu_lora[i], terms[3:], [_base(m).weight.shape[0] for m in gu]
                )

    def fused_weights(self) -> tuple[torch.Tensor, ...]:
        """The concatenated weights in use (their addresses are part of what a recorded graph reads)."""
        lora = [t for pair in (*self._qkv_lora, *self._gu_lora) if pair is not None for t in pair]
        return tuple(w for w in (*self._qkv_w, *self._gu_w, *lora) if w is not None)

    def _project(self, h: torch.Tensor, weight: torch.Tensor, lora: tuple | None) -> torch.Tensor:
        """A fused group's projections of ``h``: the base matmul, plus its LoRA term in the factors' dtype
        (the dtype flow of PEFT's forward: the sum in the wider dtype, then back to the base's)."""
        out = self._linear(h, weight)
        if lora is None:
            return out
        a, b = lora
        return (out + F.linear(F.linear(h.to(a.dtype), a), b)).to(out.dtype)

    def fused_bytes(self) -> int:
        """Bytes of the concatenated weights allocated so far (0 before the first generation)."""
        return sum(w.numel() * w.element_size() for w in self.fused_weights())

    @property
    def dtype(self) -> torch.dtype:
        return self.body.embed_tokens.weight.dtype

    def new_cache(self, batch: int, length: int, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed ``(k, v)`` caches: one ``[B, KV, L, D]`` tensor per layer, in the model's dtype.

        One tensor per layer rather than one stacked tensor: under ``torch.compile`` an in-place write into
        a view of a graph input can be functionalised into a scatter over the whole base tensor.
        """
        if self.window is not None and length > self.window:
            raise ValueError(f"sequence length {length} exceeds the sliding window {self.window}")
        shape = (batch, self.n_kv, length, self.head_dim)

        def make():
            return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in self.layers]

        return make(), make()

    def rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[B, L]`` -> ``(cos, sin)`` each ``[B, L, D]`` from the model's rotary module."""
        dummy = torch.empty(0, dtype=self.dtype, device=positions.device)
        return self.body.rotary_emb(dummy, positions)

    def _qkv(self, attn, h: torch.Tensor, lead: tuple[int, ...]):
        q = attn.q_proj(h).view(*lead, self.n_heads, self.head_dim)
        k = attn.k_proj(h).view(*lead, self.n_kv, self.head_dim)
        v = attn.v_proj(h).view(*lead, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def prefill(self, input_ids, attention_mask, cos, sin, k_cache, v_cache) -> torch.Tensor:
        """Run the prompt, fill cache slots ``[0, P)``, return the last position's normed hidden state.

        Args:
            input_ids: ``[B, P]`` left-padded prompts.
            attention_mask: ``[B, P]`` 1 for real tokens.
            cos: ``[B, P, D]`` rotary cosines of the prompt positions (``sin`` likewise).
            k_cache: per layer ``[B, KV, L, D]``, written in place (``v_cache`` likewise).

        Returns:
            ``[B, H]`` final-norm hidden state at position ``P - 1``.
        """
        b, p = input_ids.shape
        key_ok = attention_mask.bool()
        causal = torch.ones(p, p, dtype=torch.bool, device=input_ids.device).tril()
        # a pad query sees itself, so its (unused) output is finite and never NaN-poisons the cache
        mask = (causal[None] & key_ok[:, None, :]) | torch.eye(p, dtype=torch.bool, device=input_ids.device)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x = self.body.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), (b, p))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KV, P, D]
            k_cache[i][:, :, :p] = k
            v_cache[i][:, :, :p] = v
            # the prompt is attended once per rollout, so expanding K/V here costs little
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=self.scale
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, p, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.body.norm(x[:, -1])

    def decode(
        self, tokens, slot, cos, sin, key_valid, k_cache, v_cache, kv_len: int | None = None
    ) -> torch.Tensor:
        """One token per row: write its K/V at cache slot ``slot`` and attend over the valid slots.

        Args:
            tokens: ``[B]`` the tokens to feed.
            slot: ``[1]`` int64 cache slot of these tokens (a tensor, so the step can be graph-captured).
            cos: ``[B, D]`` rotary cosines at the tokens' positions (``sin`` likewise).
            key_valid: ``[B, L]`` bool, True for slots the tokens may attend to (including ``slot``).
            k_cache: per layer ``[B, KV, L, D]``, written in place (``v_cache`` likewise).
            kv_len: attend over slots ``[0, kv_len)`` only (must include ``slot``); None = all ``L``.

        Returns:
            ``[B, H]`` final-norm hidden states.
        """
        b = tokens.shape[0]
        cos_q, sin_q = cos[:, None, None, :], sin[:, None, None, :]
        cos_k, sin_k = cos[:, None, :], sin[:, None, :]
        n = k_cache[0].shape[2] if kv_len is None else kv_len
        valid = key_valid[:, :n]
        # no slot past this step's is valid: the Triton kernel stops there at run time (one shape for the
        # whole response: a compiled step's ``n`` is the whole cache)
        kv_end = slot + 1 if self.attention == "triton" else None
        x = self.body.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            fused = self.fused[i] and self.fused_now[i]
            if fused:
                qkv = self._project(h, self._qkv_w[i], self._qkv_lora[i])
                sizes = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
                q, k, v = (z.view(b, -1, self.head_dim) for z in qkv.split(sizes, dim=-1))
                if self.qk_norm:
                    q, k = attn.q_norm(q), attn.k_norm(k)
            else:
                q, k, v = self._qkv(attn, h, (b,))
            q = _rope(q.view(b, self.n_kv, self.group, self.head_dim), cos_q, sin_q)
            k = _rope(k, cos_k, sin_k)
            k_cache[i].index_copy_(2, slot, k[:, :, None, :])
            v_cache[i].index_copy_(2, slot, v[:, :, None, :])
            o = gqa_decode_attention(
                q, k_cache[i][:, :, :n], v_cache[i][:, :, :n], valid, self.scale, self.attention, kv_end
            )
            out = self._out_linear[i]
            x = x + (out(o.reshape(b, -1), attn.o_proj.weight) if out else attn.o_proj(o.reshape(b, -1)))
            if fused:
                mlp = layer.mlp
                gate, up = self._project(
                    layer.post_attention_layernorm(x), self._gu_w[i], self._gu_lora[i]
                ).chunk(2, dim=-1)
                act = mlp.act_fn(gate) * up
                x = x + (out(act, mlp.down_proj.weight) if out else mlp.down_proj(act))
            else:
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.body.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> ``[B, V]`` float32 logits (one position per row only)."""
        return self.lm_head(hidden).float()
