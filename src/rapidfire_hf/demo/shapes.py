"""Llama model shapes shared by the benchmarks and demos (``LlamaConfig`` keyword arguments, random init).

``llama-1.1b`` is the shape the project's baseline numbers use (docs/results.md); ``llama-7b`` is Llama-2-7B's;
``llama-15b`` (15.6B parameters: Llama-2-13B's width, 48 layers) is a policy too large to train with PPO on
one 141 GB GPU even in pure bf16 (weights, gradients, AdamW state and a reference copy: ~10 bytes per
parameter) that two GPUs train sharded (``SET=bf16 benchmarks/distributed/largest_model.sh``); ``llama-160m`` is a small GQA shape for learning runs; ``llama-tiny`` and ``smoke`` are for CPU checks.
"""

from __future__ import annotations


def _shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
    )


LLAMA_SHAPES: dict[str, dict] = {
    "llama-15b": _shape(5120, 48, 40, 40, 13824, 32000),
    "llama-7b": _shape(4096, 32, 32, 32, 11008, 32000),
    "llama-1.1b": _shape(2048, 22, 32, 4, 5632, 32000),
    "llama-160m": _shape(768, 8, 12, 4, 2048, 32000),
    "llama-tiny": _shape(256, 4, 8, 4, 512, 512),
    "smoke": _shape(64, 2, 4, 2, 128, 512),
}


def llama_shape(name: str, **overrides) -> dict:
    """A copy of ``LLAMA_SHAPES[name]`` with ``overrides`` applied; a clear error for an unknown name."""
    if name not in LLAMA_SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(LLAMA_SHAPES)}")
    return {**LLAMA_SHAPES[name], **overrides}


# the short keys the benchmarks' own shape tables use -> LlamaConfig's keyword arguments
SHORT_KEYS = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
}


def config_kwargs(short: dict) -> dict:
    """``LlamaConfig`` keyword arguments of a shape written with :data:`SHORT_KEYS` (other keys of
    ``short``, such as a sequence length, are left out)."""
    return {name: short[key] for key, name in SHORT_KEYS.items()}


def llama_config(shape: dict, max_position_embeddings: int, **extra):
    """A ``LlamaConfig`` of ``shape`` with the demos' special tokens (pad 0, bos 1, eos 2) and one label
    (so the same config builds a causal LM and a sequence-classification value/reward model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **shape,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_labels=1,
        **extra,
    )


# Published hyper-parameters of other decoder families (random init; nothing is downloaded), for the benchmarks
# that compare families at a real size: ``family -> (transformers config class, its keyword arguments)``.
# ``vocab_size`` is each model's own; the benchmarks' tokenizers are built in code to match.
FAMILY_SHAPES: dict[str, tuple[str, dict]] = {
    # google/gemma-3-1b-pt: 5 local (window 512, RoPE base 1e4) : 1 global layer (RoPE base 1e6)
    "gemma3-1b": (
        "Gemma3TextConfig",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            sliding_window=512,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-6,
        ),
    ),
    # allenai/OLMo-2-0425-1B
    "olmo2-1b": (
        "Olmo2Config",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=100352,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    # microsoft/Phi-3-mini-4k-instruct
    "phi3-mini": (
        "Phi3Config",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            sliding_window=2047,
        ),
    ),
    # EleutherAI/pythia-1b
    "pythia-1b": (
        "GPTNeoXConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=8,
            vocab_size=50304,
            rotary_pct=0.25,
            use_parallel_residual=True,
        ),
    ),
    # Qwen/Qwen3-30B-A3B's layer (128 experts, 8 routed per token), 12 of its 48 layers to fit one card
    "qwen3moe-12l": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
        ),
    ),
}


def family_config(name: str, max_position_embeddings: int, **extra):
    """The transformers config of :data:`FAMILY_SHAPES` ``[name]`` with the demos' special tokens (pad 0, bos 1,
    eos 2) and one label, as :func:`llama_config` (so one config builds the causal LM and the
    sequence-classification value/reward model of that family); ``extra`` overrides any of it."""
    import transformers

    if name not in FAMILY_SHAPES:
        raise KeyError(f"unknown family shape {name!r}; known: {', '.join(FAMILY_SHAPES)}")
    cls_name, kwargs = FAMILY_SHAPES[name]
    settings = dict(kwargs, max_position_embeddings=max_position_embeddings, pad_token_id=0, bos_token_id=1)
    return getattr(transformers, cls_name)(**{**settings, "eos_token_id": 2, "num_labels": 1, **extra})
