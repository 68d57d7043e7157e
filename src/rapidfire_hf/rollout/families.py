"""How each supported decoder family differs from Llama: a table of small declared switches.

``StaticLlama`` (rollout/llama_forward.py) is one forward over a static KV cache; everything a family does
differently is one field of :class:`Family` (module names, where the norms sit, how q/k/v are laid out) or
a number read from the model's config where the family declares it (soft-capping, Granite's multipliers,
sliding windows, no-RoPE layers). Norms, projections, MLPs and MoE blocks stay the model's own modules
(Gemma's ``1 + w`` norms are computed from their weights in the modules' arithmetic: ``offset_norm``).
The arithmetic of each switch follows the family's modeling file in ``transformers`` (5.x).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from rapidfire_hf.models.plumbing import layer_windows

# the four norm positions of a decoder layer: before / after attention, before / after the MLP
PRE_NORM = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
POST_NORM = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")

QKV_LAYOUTS = ("split", "fused", "neox")
QK_NORMS = (None, "head", "proj")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    """One model_type's decoder, as switches on the shared forward.

    Attributes:
        final_norm: the body's final norm module.
        attn: a layer's attention module.
        out_proj: the attention's output projection.
        norms: module names at (before attention, after attention, before MLP, after MLP), None where absent.
        qkv: ``"split"`` (q_proj / k_proj / v_proj), ``"fused"`` (one ``qkv_proj``: all q heads, then k,
            then v; Phi-3) or ``"neox"`` (one ``query_key_value`` laid out per head as [q | k | v]; GPT-NeoX).
        qk_norm: None, ``"head"`` (q_norm / k_norm per head after the view: Qwen3, Gemma-3) or ``"proj"``
            (over the whole projection before the view: OLMo-2).
        qk_names: the attention's q and k norm modules (``qk_norm``'s).
        qk_flag: a config flag that switches the q/k norms on (Phi's ``qk_layernorm``; None: always on).
        qk_after_rope: per-head q/k norms after the rotary embedding, not before (Hunyuan-V1-Dense).
        parallel_residual: attention and MLP both read the layer input (GPT-NeoX's use_parallel_residual).
        mlp: a layer's MLP (or routed MoE block) module.
        shared_mlp: a layer's always-on MLP added to its routed block's output (Granite-MoE-shared's
            ``shared_mlp``; None in a layer without one).
        moe: the MLP is a routed mixture of experts: decoded by ``rollout/moe_decode.py`` (the model's router
            and stacked expert weights, no host sync), or its own module on ``[B, 1, H]`` for other layouts.
        embed_scale: embeddings times sqrt(hidden), the factor rounded to the embedding dtype (Gemma).
        softcap: attention-logit and final-logit soft-capping from the config (Gemma-2/3).
        multipliers: Granite's embedding / residual multipliers and logits scaling from the config.
        nope_layers: the config's ``no_rope_layers`` marks layers without rotary embeddings (SmolLM3).
        global_nope: where the config has a sliding window, its full-attention layers take no rotary
            embedding (EXAONE-4's and Cohere-2's hybrid attention; an EXAONE-4 without a window rotates every
            layer, and transformers' Cohere-2 refuses a config without one).
        shared_norm: attention and MLP read one normed input, summed ``x + attn + mlp`` (Cohere-2), or
            ``attn + mlp + x`` with ``residual_last`` (Phi), the order of additions each model computes.
        residual_last: see ``shared_norm``.
        rope_pairs: rotary embedding over adjacent dims ``(2j, 2j + 1)``, in fp32 (Cohere-2), not halves.
        rope_interleave: adjacent dims rotate together too, from the rotary module's usual table in halves:
            its first half, each frequency repeated, applied in q's dtype (GLM, GLM-4, Helium, ERNIE-4.5).
        logit_scale: the logits times the config's ``logit_scale`` (Cohere-2).
        clip_qkv: the config's ``clip_qkv`` (when set) clamps q, k and v to ``[-c, c]`` after the q/k norms,
            before the heads are split (OLMo, OLMoE).
        offset_norm: the RMSNorms scale by ``1 + w`` in fp32 and cast after (Gemma 1/2/3): the static forward
            computes them from their weights with ``1 + w`` precomputed once per generation, and a layer's
            per-head q and k norms in one pass (rollout/llama_forward.py, ``offset_rms_norm``).
    """

    final_norm: str = "norm"
    attn: str = "self_attn"
    out_proj: str = "o_proj"
    mlp: str = "mlp"
    shared_mlp: str | None = None
    norms: tuple = PRE_NORM
    qkv: str = "split"
    qk_norm: str | None = None
    qk_names: tuple = ("q_norm", "k_norm")
    qk_flag: str | None = None
    qk_after_rope: bool = False
    parallel_residual: bool = False
    moe: bool = False
    embed_scale: bool = False
    softcap: bool = False
    multipliers: bool = False
    nope_layers: bool = False
    global_nope: bool = False
    shared_norm: bool = False
    residual_last: bool = False
    rope_pairs: bool = False
    rope_interleave: bool = False
    logit_scale: bool = False
    clip_qkv: bool = False
    offset_norm: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "gemma": Family(embed_scale=True, offset_norm=True),
    "gemma2": Family(embed_scale=True, norms=SANDWICH, softcap=True, offset_norm=True),
    "gemma3_text": Family(embed_scale=True, norms=SANDWICH, qk_norm="head", softcap=True, offset_norm=True),
    "olmo2": Family(norms=POST_NORM, qk_norm="proj"),
    "olmo3": Family(norms=POST_NORM, qk_norm="proj"),  # OLMo-2's layer; windows and RoPE per layer type
    "exaone4": Family(norms=POST_NORM, qk_norm="head", global_nope=True),
    "cohere2": Family(
        norms=("input_layernorm", None, None, None),
        shared_norm=True,
        rope_pairs=True,
        logit_scale=True,
        global_nope=True,
    ),  # fmt: skip
    "phi3": Family(qkv="fused"),
    # Phi-1.5 / Phi-2: Cohere's parallel layer (attn + mlp + x), biased projections, partial rotary, a
    # LayerNorm per head on q and k where the config asks (qk_layernorm)
    "phi": Family(
        final_norm="final_layernorm",
        out_proj="dense",
        norms=("input_layernorm", None, None, None),
        shared_norm=True,
        residual_last=True,
        qk_norm="head",
        qk_names=("q_layernorm", "k_layernorm"),
        qk_flag="qk_layernorm",
    ),
    # Llama's layer with adjacent-pair rotary (GLM: partial, over the first half of each head)
    "helium": Family(rope_interleave=True),
    "glm": Family(rope_interleave=True),
    "ernie4_5": Family(rope_interleave=True),
    "glm4": Family(
        norms=(
            "input_layernorm",
            "post_self_attn_layernorm",
            "post_attention_layernorm",
            "post_mlp_layernorm",
        ),
        rope_interleave=True,
    ),
    "olmo": Family(clip_qkv=True),  # OLMo-1: non-parametric LayerNorms (its own modules), clip_qkv
    "ministral": Family(),  # Mistral's layer; sliding window per layer type
    "nemotron": Family(),  # LayerNorm1P (its own modules), partial rotary, an ungated ReLU-squared MLP
    "seed_oss": Family(),  # Llama's layout; biases where the config asks (its own modules)
    "arcee": Family(),  # Llama's attention; an ungated ReLU-squared MLP (its own module)
    "apertus": Family(norms=("attention_layernorm", None, "feedforward_layernorm", None), qk_norm="head"),
    "hunyuan_v1_dense": Family(
        qk_norm="head", qk_names=("query_layernorm", "key_layernorm"), qk_after_rope=True
    ),  # fmt: skip
    "starcoder2": Family(),  # Llama's layout with LayerNorm, biased projections and a GELU MLP (its own modules)
    "gpt_neox": Family(
        final_norm="final_layer_norm", attn="attention", out_proj="dense", qkv="neox", parallel_residual=True
    ),  # fmt: skip
    "granite": Family(multipliers=True),
    "smollm3": Family(nope_layers=True),
    "qwen3_moe": Family(qk_norm="head", moe=True),
    "mixtral": Family(moe=True),
    "olmoe": Family(qk_norm="proj", moe=True, clip_qkv=True),  # pre-norm; q/k norms over the projection
    "flex_olmo": Family(norms=POST_NORM, qk_norm="proj", moe=True),  # OLMo-2's layer, OLMoE's routed experts
    # Qwen2's attention (q/k/v biases); routed experts beside a sigmoid-gated shared one (rollout/moe_decode.py)
    "qwen2_moe": Family(moe=True),
    # Granite's multipliers; a router named `router` (softmax of the top-k logits); Granite-MoE-shared adds an
    # always-on MLP to the routed output
    "granitemoe": Family(mlp="block_sparse_moe", multipliers=True, moe=True),
    "granitemoeshared": Family(mlp="block_sparse_moe", shared_mlp="shared_mlp", multipliers=True, moe=True),
}


def family_of(config) -> Family | None:
    """The :class:`Family` of an HF config (None when its model_type is not in :data:`FAMILIES`)."""
    return FAMILIES.get(getattr(config, "model_type", None))


def rope_kinds(config, body) -> list[str | None]:
    """Per layer: which rotary table it reads (None: no rotary embedding at all, SmolLM3's NoPE layers).

    A rotary module whose ``forward`` takes a ``layer_type`` (Gemma-3: a RoPE base per layer type) gives one
    table per layer type; a separate ``rotary_emb_local`` (older Gemma-3 code) serves the sliding layers;
    otherwise every layer reads the one ``"default"`` table.
    """
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)[:n]
    if "layer_type" in inspect.signature(body.rotary_emb.forward).parameters:
        kinds = list(types)
    elif hasattr(body, "rotary_emb_local"):
        kinds = ["local" if t == "sliding_attention" else "default" for t in types]
    else:
        kinds = ["default"] * n
    fam = family_of(config)
    if fam is not None and fam.nope_layers:
        use_rope = getattr(config, "no_rope_layers", None) or [1] * n
        kinds = [k if use_rope[i] else None for i, k in enumerate(kinds)]
    if fam is not None and fam.global_nope and getattr(config, "sliding_window", None) is not None:
        kinds = [k if t == "sliding_attention" else None for k, t in zip(kinds, types)]
    return kinds


def rotary_tables(body, kinds: list[str | None], x, positions):
    """``(cos, sin)`` per distinct kind in first-use order, each ``[B, L, Dr]`` from the model's rotary module(s)."""
    out = {}
    for kind in kinds:
        if kind is None or kind in out:
            continue
        if kind == "local" and hasattr(body, "rotary_emb_local"):
            out[kind] = body.rotary_emb_local(x, positions)
        elif kind == "default":
            out[kind] = body.rotary_emb(x, positions)
        else:
            out[kind] = body.rotary_emb(x, positions, layer_type=kind)
    return out


def rope_types(body) -> list[str]:
    """The rotary module's rope type(s) (Gemma-3 keeps one per layer type)."""
    kinds = getattr(body.rotary_emb, "rope_type", "default")
    found = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    local = getattr(body, "rotary_emb_local", None)
    if local is not None:
        found.append(getattr(local, "rope_type", "default"))
    return found


def family_reason(lm) -> str | None:
    """Why the static forward cannot run ``lm`` (an unwrapped HF causal LM) by its family (None when it can)."""
    cfg = getattr(lm, "config", None)
    model_type = getattr(cfg, "model_type", None)
    fam = family_of(cfg)
    if fam is None:
        return f"model_type {model_type!r} is not one of the {len(FAMILIES)} native families (docs/models.md)"
    unknown = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if t not in LAYER_TYPES})
    if unknown:
        return f"layer types {unknown} are not supported (only {list(LAYER_TYPES)})"
    windows = {w for w in layer_windows(cfg) if w is not None}
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in windows):
        return f"sliding_window={sorted(windows, key=str)} is not a positive number of tokens"
    clip = getattr(cfg, "clip_qkv", None) if fam.clip_qkv else None
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        return f"clip_qkv={clip!r} is not a positive number"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention=True) is not a causal decoder"
    body = getattr(lm, "base_model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "the model has no decoder `.layers` / `.rotary_emb`"
    if not hasattr(body, fam.final_norm):
        return f"the decoder has no final norm `{fam.final_norm}`"
    layer = body.layers[0] if len(body.layers) else None
    attn = getattr(layer, fam.attn, None)
    needed = [n for n in fam.norms if n] + [fam.mlp]
    missing = [n for n in needed if not hasattr(layer, n)] + ([fam.attn] if attn is None else [])
    missing += [n for n in (fam.out_proj, "scaling") if attn is not None and not hasattr(attn, n)]
    if fam.qk_norm and (fam.qk_flag is None or getattr(cfg, fam.qk_flag, False)):
        missing += [n for n in fam.qk_names if attn is not None and not hasattr(attn, n)]
    if missing:
        return f"its layers lack {missing}, which model_type {model_type!r} has"
    if any(t in ("dynamic", "longrope") for t in rope_types(body)):
        return "length-dependent rotary scaling (dynamic/longrope) is not supported"
    return None
