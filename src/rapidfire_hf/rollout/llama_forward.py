"""One decoder forward pass over a static KV cache for every supported family, run on the HF modules' own
weights (the families' differences are the switches of rollout/families.py; docs/models.md lists them).

Only attention is re-implemented (so no HF cache object or mask builder is in the loop); embeddings,
norms, projections and MLPs are the model's modules, called directly (a routed MoE block at decode:
rollout/moe_decode.py, on its own router and expert weights, so the step can be recorded; Gemma's ``1 + w``
RMSNorms from their weights, :func:`offset_rms_norm`, the module's arithmetic with ``1 + w`` precomputed per
generation), so PEFT LoRA layers wrapped around ``q_proj`` etc. keep working and generation always sees the
current training weights.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from rapidfire_hf.kernels import gqa_decode_attention
from rapidfire_hf.kernels.decode_attention import IMPLS
from rapidfire_hf.kernels.kv_quant import dequantize, kv_format
from rapidfire_hf.models import unwrap_peft
from rapidfire_hf.models.plumbing import layer_windows
from rapidfire_hf.rollout.families import (
    FAMILIES,
    family_of,
    family_reason,
    rope_kinds,
    rotary_tables,
)
from rapidfire_hf.rollout.kv_layout import KVLayout
from rapidfire_hf.rollout.moe_decode import (
    MOE_FORMS,
    grouped_by_default,
    grouped_form_reason,
    is_moe_block,
    moe_layout_reason,
    routed_moe,
)
from rapidfire_hf.rollout.sharded import ZERO3_PARTITIONED, zero3_partitioned

DECODE_LINEARS = ("torch", "triton")

# model_type -> the family's switches (rollout/families.py); kept under this name for callers
SUPPORTED = FAMILIES


def unsupported_reason(model, gathered: bool = False) -> str | None:
    """Why the static engine cannot run ``model`` (None when it can): the one place that decides whether the
    native decode path runs (its family, layer types, rotary scaling) or ``rollout_backend="auto"`` falls back.
    ``gathered``: judge it as it runs inside a gather of its ZeRO-3 partitions (PPOTrainer's rollout)."""
    lm = unwrap_peft(model)
    reason = family_reason(lm)
    if reason is not None:
        return reason
    if not gathered and zero3_partitioned(lm):
        return ZERO3_PARTITIONED
    return None


def ring_windows(model) -> tuple[int | None, ...]:
    """Per layer the sliding window that bounds its static-engine cache (a ring of ``min(window, P + R)``
    slots, :class:`~rapidfire_hf.rollout.kv_layout.KVLayout`; None: the whole rollout), as the memory planner counts it
    (``Workload.kv_windows``); () where the native path cannot run ``model`` (the generic path keeps every
    layer's cache full-length). Judged as PPOTrainer's rollout runs it, inside a ZeRO-3 gather."""
    if unsupported_reason(model, gathered=True) is not None:
        return ()
    return tuple(layer_windows(unwrap_peft(model).config))


def _fusable(layer, fam, lora: bool = False) -> bool:
    """Whether a decoder layer's q/k/v and gate/up projections are plain bias-free ``nn.Linear`` of one dtype
    (with ``lora``: or PEFT LoRA ``Linear`` layers over such a base; quantized linears and biased projections
    keep their module calls). Only families with separate q/k/v and a gated MLP (``fam``, a
    :class:`~rapidfire_hf.rollout.families.Family`): Phi-3 and GPT-NeoX already project in one matmul, MoE
    layers route their MLP."""
    if fam is None or fam.qkv != "split" or fam.moe:
        return False
    attn, mlp = getattr(layer, fam.attn), getattr(layer, fam.mlp)
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
    if unsupported_reason(model) is not None:
        return 0  # the generic path (rollout/generic_forward.py) fuses nothing
    lm = unwrap_peft(model)
    fam = family_of(getattr(lm, "config", None))
    if fam is None:
        return 0
    total = 0
    for layer in list(lm.base_model.layers[: lm.config.num_hidden_layers]):
        if _fusable(layer, fam, lora):
            attn, mlp = getattr(layer, fam.attn), getattr(layer, fam.mlp)
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                w = _base(m).weight
                total += w.numel() * w.element_size()
    return total


def _plain(module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def _plain_outputs(layer, fam) -> bool:
    """Whether a decoder layer's o and down projections are plain bias-free ``nn.Linear``."""
    return _plain(getattr(getattr(layer, fam.attn), fam.out_proj, None)) and _plain(
        getattr(getattr(layer, fam.mlp, None), "down_proj", None)
    )


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


def _offset_into(out: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """``1 + weight.float()`` into ``out`` (reallocated when its shape or device no longer fit)."""
    if out is None or out.shape != weight.shape or out.device != weight.device:
        return 1.0 + weight.detach().float()
    return out.copy_(weight.detach()).add_(1.0)  # fp32 copy of the weight (exact), then + 1 in fp32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Cohere's rotation: dims ``(2j, 2j + 1)`` form pair ``j``, rotated to ``(-x[2j + 1], x[2j])``."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str | None = None) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` dims of ``x``; the rest pass through (partial rotary:
    GPT-NeoX's rotary_pct, Phi-3's partial_rotary_factor, GLM's half). Computed in the table's dtype and
    returned in ``x``'s: OLMo-2's rotary module keeps fp32 tables and its model rounds the rotated q/k back.
    ``pairs``: adjacent dims rotate together, ``"fp32"`` in fp32 as Cohere's model computes them
    (``Family.rope_pairs``), ``"dtype"`` in ``x``'s dtype (``Family.rope_interleave``: GLM, Helium, ERNIE)."""
    d = cos.shape[-1]
    rot = x if d == x.shape[-1] else x[..., :d]
    if pairs == "fp32":
        rot = rot.float()
    out = (rot * cos + (_rotate_pairs(rot) if pairs else _rotate_half(rot)) * sin).to(x.dtype)
    return out if d == x.shape[-1] else torch.cat([out, x[..., d:]], dim=-1)


# the (1 + w) RMSNorm classes of transformers whose forward :func:`offset_rms_norm` computes
OFFSET_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def is_offset_norm(module) -> bool:
    """Whether ``module`` is one of transformers' Gemma RMSNorms, unpatched (a kernel library's replacement
    class or an instance-level ``forward`` keeps its module call)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "eps", None)
    return (
        type(module).__name__ in OFFSET_NORMS
        and "forward" not in vars(module)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(eps, (int, float))
        and not isinstance(eps, bool)
    )


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm in the arithmetic of its module (fp32 normalisation, times ``1 + w`` in fp32, cast
    back), with ``scale = 1 + w.float()`` computed beforehand: two kernels fewer per norm, the same bits.
    ``scale`` broadcasts over ``x``'s last dims (``[H]``, or ``[heads, D]`` for q and k normed together)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by ``rope = (cos, sin, pairs)`` (:func:`_rope`); unchanged for None."""
    if rope is None:
        return q, k
    return _rope(q, *rope), _rope(k, *rope)


def _capped_attention(q, k, v, allowed, scale: float, softcap: float) -> torch.Tensor:
    """Attention with tanh soft-capped logits (Gemma-2/3), in the order of HF's eager attention: logits in
    the inputs' dtype, scaled, capped, masked, an fp32 softmax cast back. No fused kernel takes the cap.

    Args:
        q: ``[B, KV, G, D]`` (decode) or ``[B, H, P, D]`` (prefill, ``k``/``v`` expanded to ``H`` heads).
        k: ``[B, KV, L, D]`` keys (``v`` likewise).
        allowed: bool mask broadcastable to the ``[..., L]`` logits.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def attention_softcap(config, softcap: float | None) -> float | None:
    """The attention soft-cap the model's own forward applies: ``softcap`` (the config's
    ``attn_logit_softcapping``), or None where the model attends through transformers' sdpa, which has no cap
    (transformers 5.17 runs Gemma-2 on sdpa by default and drops the cap silently; later releases refuse sdpa
    with a cap). The engine follows the model the user brought, so the rollout's tokens and log-probs are the
    training forward's (PPO's ratio and KL read both); said once, with how to get the capped model."""
    impl = str(getattr(config, "_attn_implementation", None) or "")
    if softcap is None or "sdpa" not in impl:
        return softcap
    warnings.warn(
        f"the model's own forward runs attn_implementation={impl!r}, which leaves out its attention "
        f"soft-capping (attn_logit_softcapping={softcap}); the rollout engine follows it (no attention cap), so "
        "rollout and training log-probs agree. For the model as defined, load it with "
        "attn_implementation='eager'",
        stacklevel=3,
    )
    return None


class StaticLlama:
    """Prefill and one-token decode for the supported decoder families, with the cache passed in explicitly.

    One forward for every family in :data:`rapidfire_hf.rollout.families.FAMILIES`: its differences from
    Llama are the switches of its :class:`~rapidfire_hf.rollout.families.Family` (module names, norm
    positions, q/k/v layout, q/k norms, parallel residual, MoE module calls, scaled embeddings, soft-capping,
    Granite's multipliers, no-RoPE layers), plus the config's sliding windows and per-layer-type rotary
    tables. Where each layer's K/V go in its cache (a ring of ``window`` slots for a sliding window shorter
    than the rollout), and the prefill and decode masks, are its :attr:`layout`
    (:class:`~rapidfire_hf.rollout.kv_layout.KVLayout`). Every decode attention takes a ring: SDPA, matmul
    and the soft-capped attention mask it; the Triton kernel reads all of it (its ``kv_end`` bound applies to
    full-length caches only).

    Args:
        model: an HF causal LM of a supported family, possibly wrapped by PEFT.
        attention: decode attention implementation, see :func:`rapidfire_hf.kernels.gqa_decode_attention`
            (layers with soft-capped logits use :func:`_capped_attention` whatever it says).
        fuse_projections: decode each layer's q/k/v projections as one matmul and its gate/up projections as
            another, from concatenated copies of their weights (:meth:`refresh_fused` copies the current
            weights in before each generation). At decode batch sizes every projection reads its whole
            weight for a few rows, so fewer, larger matmuls waste less of each weight read and launch (the
            profile in benchmarks/kernels: the weight GEMMs are ~1.1 of 1.78 ms per step at 1.1B batch 8,
            against a 0.45 ms floor for the whole step). Costs a second copy of those weights (1.2 GB at
            1.1B). Layers whose projections are not plain bias-free ``nn.Linear`` (PEFT LoRA, quantized,
            biased) keep the module calls, as do families that already project in one matmul (Phi-3,
            GPT-NeoX) and MoE layers. On one H200 (benchmarks/kernels, third call) the step is 1.21x faster at
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
        kv_cache_dtype: None (the cache in the model's dtype), ``"fp8"`` or ``"int8"``: an 8-bit cache with
            one fp32 scale per (row, K/V head, token) (``kernels/kv_quant.py``), 0.516x the bytes of a bf16
            cache at head width 128. Writes quantize the new K/V; the Triton attention dequantizes inside the
            kernel, SDPA / matmul / soft-capped attention dequantize the slots the step reads first. The
            prompt's own prefill attention runs on the unquantized K/V; every decode step reads the 8-bit cache.
        sliding_cache: ``"ring"`` (default: a local layer's cache holds ``min(window, P + R)`` slots, see
            above) or ``"full"`` (every layer ``P + R`` slots, a local layer's window a mask over them: the
            engine before the ring, kept to measure the two against each other, benchmarks/rollout/families.py
            ``--sliding-cache``; set on a built net as the attribute of this name before its first cache).
        moe_form: None (default: :func:`~rapidfire_hf.rollout.moe_decode.default_form` picks by batch and
            device) or one of ``MOE_FORMS`` (``"gather"``, ``"dense"``, ``"grouped"``) forced for every
            routed MoE layer, to measure the forms against each other (benchmarks/rollout/families.py
            ``--moe-form``); set on a built net as the attribute of this name before its first step. A form
            that cannot run (``"grouped"`` without torch's one-kernel grouped GEMM) is refused by name.
    """

    def __init__(
        self,
        model,
        attention: str = "sdpa",
        fuse_projections: bool = False,
        linear: str = "torch",
        fuse_lora: bool = False,
        kv_cache_dtype: str | None = None,
        sliding_cache: str = "ring",
        moe_form: str | None = None,
    ):
        kv = kv_format(kv_cache_dtype)
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
        fam = self.family = family_of(cfg)
        self.body = lm.base_model
        self.embed = self.body.get_input_embeddings()
        self.final_norm = getattr(self.body, fam.final_norm)
        self.lm_head = lm.get_output_embeddings()
        self.layers = list(self.body.layers[: cfg.num_hidden_layers])
        self.attns = [getattr(layer, fam.attn) for layer in self.layers]
        self.out_projs = [getattr(attn, fam.out_proj) for attn in self.attns]
        self.norms = [tuple(getattr(layer, n) if n else None for n in fam.norms) for layer in self.layers]
        attn = self.attns[0]
        self.n_heads = cfg.num_attention_heads
        # GPT-NeoX's fused layout has every head's k and v (its config has no num_key_value_heads)
        self.n_kv = (getattr(cfg, "num_key_value_heads", None) if fam.qkv != "neox" else None) or self.n_heads
        self.group = self.n_heads // self.n_kv
        self.head_dim = getattr(attn, "head_dim", None) or attn.head_size
        self.scale = attn.scaling
        self.hidden = cfg.hidden_size
        # the q/k norms where the family has them and the config (if it has a flag) switches them on
        self.qk_norm = fam.qk_norm if fam.qk_flag is None or getattr(cfg, fam.qk_flag, False) else None
        self._q_norms = [getattr(a, fam.qk_names[0], None) if self.qk_norm else None for a in self.attns]
        self._k_norms = [getattr(a, fam.qk_names[1], None) if self.qk_norm else None for a in self.attns]
        self._qk_after_rope = fam.qk_after_rope
        clip = getattr(cfg, "clip_qkv", None) if fam.clip_qkv else None
        self.clip_qkv = None if clip is None else float(clip)
        # where each layer's K/V go in its cache (a ring for a short sliding window), the steps' masks
        self.layout = KVLayout(tuple(layer_windows(cfg)), sliding_cache, kv, self.n_kv, self.head_dim)
        kinds = rope_kinds(cfg, self.body)
        self.rope_kinds = kinds
        self._tables = list(dict.fromkeys(k for k in kinds if k is not None))  # rotary tables, in this order
        self._table_of = [None if k is None else self._tables.index(k) for k in kinds]
        cap = getattr(cfg, "attn_logit_softcapping", None) if fam.softcap else None
        self.attn_softcap = attention_softcap(cfg, cap)  # None where the model's own attention drops it
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) if fam.softcap else None
        self.parallel = fam.parallel_residual and bool(getattr(cfg, "use_parallel_residual", True))
        self.shared_norm = fam.shared_norm
        # how adjacent-pair rotary runs (None: halves): "fp32" (Cohere), "dtype" (GLM, Helium, ERNIE-4.5)
        self.rope_pairs = "fp32" if fam.rope_pairs else ("dtype" if fam.rope_interleave else None)
        self._rope_interleave = fam.rope_interleave
        self.residual_last = fam.residual_last
        self.logit_scale = float(cfg.logit_scale) if fam.logit_scale else 1.0
        self.embed_mult = float(cfg.embedding_multiplier) if fam.multipliers else 1.0
        self.residual_mult = float(cfg.residual_multiplier) if fam.multipliers else 1.0
        self.logits_scaling = float(cfg.logits_scaling) if fam.multipliers else 1.0
        self._embed_scale = None
        # routed MoE layers decoded natively; where a layout is unknown, the module call (said once)
        self._model_type, self._norm_topk = cfg.model_type, bool(getattr(cfg, "norm_topk_prob", True))
        self.mlps = [getattr(layer, fam.mlp) for layer in self.layers]
        # Granite-MoE-shared: an always-on MLP added to the routed output (None where a layer has none)
        self.shared_mlps = [
            getattr(layer, fam.shared_mlp, None) if fam.shared_mlp else None for layer in self.layers
        ]
        moe_layers = [m for m in self.mlps if fam.moe and is_moe_block(m)]
        reasons = {moe_layout_reason(m, cfg) for m in moe_layers} - {None}
        self.moe_native = [fam.moe and is_moe_block(m) and not reasons for m in self.mlps]
        self.moe_reason = next(iter(sorted(reasons)), None)
        if self.moe_reason is not None:
            warnings.warn(
                f"MoE decode runs the model's own expert modules, which a CUDA graph cannot record: {self.moe_reason}",
                stacklevel=2,
            )
        self.moe_form = moe_form
        self._qkv_sizes = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
        self.fused = [fuse_projections and _fusable(layer, fam, fuse_lora) for layer in self.layers]
        # per generation (refresh_fused): whether a fused layer runs fused now (its LoRA state reproducible)
        self.fused_now = list(self.fused)
        # with linear="triton", a fused layer's o / down projections go through it too where they are plain
        # linears; else (and with linear="torch") their module calls: a LoRA o_proj keeps its adapter
        self._out_linear = [
            self._linear if linear != "torch" and fused and _plain_outputs(layer, fam) else None
            for layer, fused in zip(self.layers, self.fused)
        ]
        self._qkv_w: list[torch.Tensor | None] = [None] * len(self.layers)  # [(Hq + 2 KV) D, H]
        self._gu_w: list[torch.Tensor | None] = [None] * len(self.layers)  # [2 I, H]
        # LoRA factors of a fused group: (A stacked [R, H], B * scaling block-diagonal [out, R]) or None
        self._qkv_lora: list[tuple | None] = [None] * len(self.layers)
        self._gu_lora: list[tuple | None] = [None] * len(self.layers)
        # offset (Gemma) norms: per layer the four norm positions' ``1 + w`` (None: a module call), the final
        # norm's, and the q and k norms' stacked per head ``[Hq + KV, D]`` (None: separate module calls)
        self._offset = [
            tuple(fam.offset_norm and n is not None and is_offset_norm(n) for n in norms)
            for norms in self.norms
        ]
        self._final_offset = fam.offset_norm and is_offset_norm(self.final_norm)
        self._qk_offset = [
            fam.offset_norm
            and self.qk_norm == "head"
            and is_offset_norm(qn)
            and is_offset_norm(kn)
            and float(qn.eps) == float(kn.eps)
            for qn, kn in zip(self._q_norms, self._k_norms)
        ]
        self._norm_scale: list[list] = [[None] * 4 for _ in self.layers]
        self._final_scale = None
        self._qk_scale: list = [None] * len(self.layers)
        self._refresh_embed_scale()
        self._refresh_norm_scales()

    def _refresh_norm_scales(self) -> None:
        """``1 + w`` in fp32 of every offset norm, from its current weight (in place where the shape, dtype and
        device still fit, so recorded graphs stay valid)."""
        with torch.no_grad():
            for i, norms in enumerate(self.norms):
                for j, module in enumerate(norms):
                    if self._offset[i][j]:
                        self._norm_scale[i][j] = _offset_into(self._norm_scale[i][j], module.weight)
            if self._final_offset:
                self._final_scale = _offset_into(self._final_scale, self.final_norm.weight)
            for i, (qn, kn) in enumerate(zip(self._q_norms, self._k_norms)):
                if self._qk_offset[i]:
                    w = torch.cat(
                        [
                            qn.weight.detach()[None].expand(self.n_heads, -1),
                            kn.weight.detach()[None].expand(self.n_kv, -1),
                        ]
                    )
                    self._qk_scale[i] = _offset_into(self._qk_scale[i], w)

    def _norm(self, module, scale, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``, or its offset form from the precomputed ``scale`` (see :func:`offset_rms_norm`)."""
        return module(x) if scale is None else offset_rms_norm(x, scale, module.eps)

    def _refresh_embed_scale(self) -> None:
        """Gemma's sqrt(hidden), rounded to the embedding dtype as the model's own multiplication rounds it
        (a Python float here, so a compiled step holds a constant)."""
        if self.family.embed_scale:
            self._embed_scale = float(torch.tensor(self.hidden**0.5, dtype=self.dtype))

    def refresh_fused(self) -> None:
        """Copy the layers' current projection weights (and LoRA factors, as the adapters stand now) into the
        concatenated ones (allocated on first use or when a weight's shape, dtype or device changed; in place
        otherwise, so recorded graphs stay valid)."""
        self._refresh_embed_scale()
        self._refresh_norm_scales()
        with torch.no_grad():
            for i in range(len(self.layers)):
                if not self.fused[i]:
                    continue
                attn, mlp = self.attns[i], self.mlps[i]
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

    def norm_scales(self) -> tuple[torch.Tensor, ...]:
        """The offset norms' precomputed ``1 + w`` in use (their addresses, too, are read by a recorded graph)."""
        scales = [s for row in self._norm_scale for s in row] + [self._final_scale, *self._qk_scale]
        return tuple(s for s in scales if s is not None)

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
        return self.embed.weight.dtype

    @property
    def sliding_cache(self) -> str:
        """``"ring"`` or ``"full"`` (:data:`~rapidfire_hf.rollout.kv_layout.SLIDING_CACHES`); set on a built net
        before its first cache (a new :attr:`layout`)."""
        return self.layout.sliding_cache

    @sliding_cache.setter
    def sliding_cache(self, value: str) -> None:
        self.layout = replace(self.layout, sliding_cache=value)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer its sliding window (None: global attention)."""
        return self.layout.windows

    @property
    def kv_format(self):
        """The 8-bit cache's :class:`~rapidfire_hf.kernels.kv_quant.KVFormat` (None: the model's dtype)."""
        return self.layout.kv_format

    def cache_lengths(self, length: int) -> list[int]:
        """Per layer the cache slots of a rollout of ``length`` slots (:meth:`KVLayout.cache_lengths`)."""
        return self.layout.cache_lengths(length)

    def new_cache(self, batch: int, length: int, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed ``(k, v)`` caches, one ``[B, KV, L_i, D]`` tensor per layer (:meth:`KVLayout.new_cache`)."""
        return self.layout.new_cache(batch, length, device, self.dtype)

    def new_cache_scales(self, batch: int, length: int, device) -> tuple[list, list] | None:
        """An 8-bit cache's ``(k_scales, v_scales)``, None otherwise (:meth:`KVLayout.new_cache_scales`)."""
        return self.layout.new_cache_scales(batch, length, device)

    def rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[B, L]`` -> ``(cos, sin)`` each ``[T, B, L, Dr]`` from the model's rotary module(s):
        one table per rotary kind the layers read (``T`` is 1 but for Gemma-3's per-layer-type bases; 0 when no
        layer rotates), ``Dr`` the rotary width (below the head width with partial rotary)."""
        dummy = torch.empty(0, dtype=self.dtype, device=positions.device)
        tables = rotary_tables(self.body, self.rope_kinds, dummy, positions)
        if not tables:
            empty = torch.zeros(0, *positions.shape, 1, dtype=self.dtype, device=positions.device)
            return empty, empty
        cos = torch.stack([tables[k][0] for k in self._tables])
        sin = torch.stack([tables[k][1] for k in self._tables])
        if self._rope_interleave:  # the table's first half, each frequency repeated for its pair of dims
            half = cos.shape[-1] // 2
            cos, sin = (t[..., :half].repeat_interleave(2, dim=-1) for t in (cos, sin))
        return cos, sin

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings, with the family's scale: Gemma's sqrt(hidden) (over a plain lookup, so an
        embedding module that scales itself is not scaled twice) or Granite's embedding multiplier."""
        e = self.embed
        if self._embed_scale is not None and isinstance(e, nn.Embedding):
            return nn.Embedding.forward(e, ids) * self._embed_scale
        x = e(ids)
        return x * self.embed_mult if self.embed_mult != 1.0 else x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> ``[B, V]`` logits in the model's dtype, final soft-capping / logits scaling applied
        (the order of the families' own ``forward``)."""
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> ``[B, V]`` float32 logits (one position per row only)."""
        return self.head(hidden).float()

    # ----- per-layer pieces ------------------------------------------------------------------------
    def _heads(self, i: int, q, k, v, lead: tuple[int, ...], rope=None):
        """Flat projections of layer ``i`` -> per-head ``[*lead, heads, D]``, with the family's q/k norms and
        the rotary embedding ``rope = (cos, sin, pairs)`` (broadcast over the heads; None: no rotation). Offset
        per-head norms run in one pass over q and k together, rotated together: the same per-row and
        per-element arithmetic as two passes, one set of kernels."""
        q_norm, k_norm = self._q_norms[i], self._k_norms[i]
        if self.qk_norm == "proj":
            q, k = q_norm(q), k_norm(k)
        if self.clip_qkv is not None:  # OLMo, OLMoE: after any norms, before the heads are split
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if self.qk_norm == "head" and self._qk_scale[i] is not None:
            qk = offset_rms_norm(torch.cat([q, k], dim=-2), self._qk_scale[i], q_norm.eps)
            if rope is not None:
                qk = _rope(qk, *rope)
            q, k = qk.split([self.n_heads, self.n_kv], dim=-2)
            return q, k, v
        if self.qk_norm == "head" and self._qk_after_rope:  # Hunyuan-V1-Dense: rotate, then norm
            q, k = _rope_qk(q, k, rope)
            return q_norm(q), k_norm(k), v
        if self.qk_norm == "head":
            q, k = q_norm(q), k_norm(k)
        return (*_rope_qk(q, k, rope), v)

    def _qkv(self, i: int, h: torch.Tensor, lead: tuple[int, ...], rope=None):
        """q, k, v ``[*lead, heads, D]`` of layer ``i`` through its own projection modules, q and k rotated
        by ``rope`` (see :meth:`_heads`)."""
        attn, layout = self.attns[i], self.family.qkv
        if layout == "neox":  # per head [q | k | v], all heads equal (no GQA)
            qkv = attn.query_key_value(h).view(*lead, self.n_heads, 3 * self.head_dim)
            q, k, v = qkv.chunk(3, dim=-1)
            return (*_rope_qk(q, k, rope), v)
        if layout == "fused":
            q, k, v = attn.qkv_proj(h).split(self._qkv_sizes, dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        return self._heads(i, q, k, v, lead, rope)

    @property
    def moe_form(self) -> str | None:
        """The expert form forced on every routed MoE layer (None: chosen per batch); see ``__init__``."""
        return self._moe_form

    @moe_form.setter
    def moe_form(self, form: str | None) -> None:
        if form is not None and form not in MOE_FORMS:
            raise ValueError(f"moe_form must be None or one of {MOE_FORMS}, got {form!r}")
        if form is not None and not any(self.moe_native):
            raise ValueError(f"moe_form={form!r}: this model has no routed MoE layer the native decode runs")
        self._grouped_ok = False
        if any(self.moe_native):
            w = next(self.mlps[i].experts.gate_up_proj for i, n in enumerate(self.moe_native) if n)
            reason = grouped_form_reason(w.device, w.dtype)
            if form == "grouped" and reason is not None:
                raise ValueError(f"moe_form='grouped' cannot run on this model: {reason}")
            # form None: default_form picks the grouped GEMM for a small batch where it records on CUDA
            self._grouped_ok = grouped_by_default(w.device, w.dtype)
        self._moe_form = form

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP on ``h``. A routed MoE block at decode (``h`` is ``[B, H]``) runs
        :func:`~rapidfire_hf.rollout.moe_decode.routed_moe` (recordable: no host sync) where its layout is
        known, else its own module on ``[B, 1, H]`` as in the model."""
        mlp, shared = self.mlps[i], self.shared_mlps[i]
        if self.moe_native[i] and h.dim() == 2:
            out = routed_moe(mlp, h, self._model_type, self._norm_topk, self._moe_form, self._grouped_ok)
        elif self.family.moe and h.dim() == 2:
            out = mlp(h[:, None, :])
            out = (out[0] if isinstance(out, tuple) else out).squeeze(1)
        else:
            out = mlp(h)
            out = out[0] if isinstance(out, tuple) else out
        return out if shared is None else out + shared(h)  # the routed output first, as the model adds

    def _residual(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + branch * self.residual_mult if self.residual_mult != 1.0 else x + branch

    def _layer(self, i: int, x: torch.Tensor, attention, mlp) -> torch.Tensor:
        """One decoder layer around ``attention(h)`` and ``mlp(h)``, with the family's norm positions and
        residual form (the order of additions of the family's own layer)."""
        pre_a, post_a, pre_m, post_m = self.norms[i]
        s_pre_a, s_post_a, s_pre_m, s_post_m = self._norm_scale[i]
        if self.shared_norm:  # Cohere, Phi: one norm read by attention and MLP, summed in the model's order
            h = self._norm(pre_a, s_pre_a, x)
            a, m = attention(h), mlp(h)
            return a + m + x if self.residual_last else x + a + m
        a = attention(self._norm(pre_a, s_pre_a, x) if pre_a is not None else x)
        if post_a is not None:
            a = self._norm(post_a, s_post_a, a)
        if self.parallel:  # GPT-NeoX: mlp_output + attn_output + hidden_states
            return mlp(self._norm(pre_m, s_pre_m, x)) + a + x
        x = self._residual(x, a)
        m = mlp(self._norm(pre_m, s_pre_m, x) if pre_m is not None else x)
        if post_m is not None:
            m = self._norm(post_m, s_post_m, m)
        return self._residual(x, m)

    # ----- prefill and decode ----------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask, cos, sin, k_cache, v_cache, scales=None) -> torch.Tensor:
        """Run the prompt, fill cache slots ``[0, P)``, return the last position's normed hidden state.

        Args:
            input_ids: ``[B, P]`` left-padded prompts.
            attention_mask: ``[B, P]`` 1 for real tokens.
            cos: ``[T, B, P, Dr]`` rotary cosines of the prompt positions, per table (``sin`` likewise).
            k_cache: per layer ``[B, KV, L_i, D]`` (:meth:`new_cache`), written in place (``v_cache``
                likewise); a local layer's ring shorter than ``P`` keeps the prompt's last ``L_i`` slots.
            scales: an 8-bit cache's ``(k_scales, v_scales)`` (:meth:`new_cache_scales`), written in place.

        Returns:
            ``[B, H]`` final-norm hidden state at position ``P - 1``.
        """
        layout = self.layout
        ks, vs = layout.split_scales(scales)
        b, p = input_ids.shape
        masks = layout.prompt_masks(attention_mask)
        cos, sin = cos[:, :, :, None, :], sin[:, :, :, None, :]
        x = self.embed_tokens(input_ids)
        for i in range(len(self.layers)):

            def attention(h, i=i):
                t = self._table_of[i]
                q, k, v = self._qkv(i, h, (b, p), None if t is None else (cos[t], sin[t], self.rope_pairs))
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KV, P, D]
                layout.write_prompt(k_cache, ks, i, k)
                layout.write_prompt(v_cache, vs, i, v)
                # the prompt is attended once per rollout, so expanding K/V here costs little
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
                q, mask = q.transpose(1, 2), masks[i][:, None]
                if self.attn_softcap is not None:
                    o = _capped_attention(q, k, v, mask, self.scale, self.attn_softcap)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
                return self.out_projs[i](o.transpose(1, 2).reshape(b, p, -1))

            x = self._layer(i, x, attention, lambda h, i=i: self._mlp(i, h))
        return self._norm(self.final_norm, self._final_scale, x[:, -1])

    def decode(
        self, tokens, slot, cos, sin, key_valid, k_cache, v_cache, kv_len: int | None = None, scales=None
    ) -> torch.Tensor:
        """One token per row: write its K/V at cache slot ``slot`` and attend over the valid slots.

        Args:
            tokens: ``[B]`` the tokens to feed.
            slot: ``[1]`` int64 cache slot of these tokens (a tensor, so the step can be graph-captured).
            cos: ``[T, B, Dr]`` rotary cosines at the tokens' positions, per table (``sin`` likewise).
            key_valid: ``[B, L]`` bool over all ``L`` slots of the rollout, True for slots the tokens may
                attend to (including ``slot``).
            k_cache: per layer ``[B, KV, L_i, D]`` (:meth:`new_cache`), written in place (``v_cache``
                likewise): a ring (``L_i < L``) at entry ``slot mod L_i``.
            kv_len: attend over slots ``[0, kv_len)`` only (must include ``slot``; a ring: its first
                ``min(kv_len, L_i)`` entries, all it has written by then); None = all.
            scales: an 8-bit cache's ``(k_scales, v_scales)`` (:meth:`new_cache_scales`).

        Returns:
            ``[B, H]`` final-norm hidden states.
        """
        layout = self.layout
        ks, vs = layout.split_scales(scales)
        b = tokens.shape[0]
        step = layout.decode_step(k_cache, key_valid, slot, kv_len)
        # no slot past this step's is valid: the Triton kernel stops there at run time (one shape for the
        # whole response: a compiled step's ``n`` is the whole cache); it reads a ring whole
        kv_end = slot + 1 if self.attention == "triton" else None
        x = self.embed_tokens(tokens)
        for i in range(len(self.layers)):
            fused = self.fused[i] and self.fused_now[i]

            def attention(h, i=i, fused=fused):
                t = self._table_of[i]
                rope = (
                    None if t is None else (cos[t][:, None, :], sin[t][:, None, :], self.rope_pairs)
                )  # over [B, heads, D]
                if fused:
                    qkv = self._project(h, self._qkv_w[i], self._qkv_lora[i])
                    q, k, v = self._heads(i, *qkv.split(self._qkv_sizes, dim=-1), (b,), rope)
                else:
                    q, k, v = self._qkv(i, h, (b,), rope)
                q = q.view(b, self.n_kv, self.group, self.head_dim)
                layout.write(k_cache, ks, i, k[:, :, None, :], step.entries[i])
                layout.write(v_cache, vs, i, v[:, :, None, :], step.entries[i])
                m, ring = step.reads[i], step.rings[i]
                kc, vc, mask = k_cache[i][:, :, :m], v_cache[i][:, :, :m], step.masks[i]
                quant = {}
                if ks is not None:  # an 8-bit cache: the slots read this step, with their scales
                    quant = {"k_scale": ks[i][:, :, :m], "v_scale": vs[i][:, :, :m]}
                if self.attn_softcap is not None:
                    if quant:
                        kc = dequantize(kc, quant["k_scale"], q.dtype)
                        vc = dequantize(vc, quant["v_scale"], q.dtype)
                    o = _capped_attention(q, kc, vc, mask[:, None, None, :], self.scale, self.attn_softcap)
                else:
                    end = None if ring else kv_end
                    o = gqa_decode_attention(q, kc, vc, mask, self.scale, self.attention, end, **quant)
                out = self._out_linear[i]
                o = o.reshape(b, -1)
                return out(o, self.out_projs[i].weight) if out else self.out_projs[i](o)

            def mlp(h, i=i, fused=fused):
                if not fused:
                    return self._mlp(i, h)
                down = self.mlps[i].down_proj
                gate, up = self._project(h, self._gu_w[i], self._gu_lora[i]).chunk(2, dim=-1)
                act = self.mlps[i].act_fn(gate) * up
                out = self._out_linear[i]
                return out(act, down.weight) if out else down(act)

            x = self._layer(i, x, attention, mlp)
        return self._norm(self.final_norm, self._final_scale, x)
