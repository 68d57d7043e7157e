"""The decoder families the static engine runs, as tiny random-init models: one table that the family tests
(tests/rollout/test_families.py) check and that renders docs/models.md (a test fails when the file drifts).

Each case is a small config of a real family whose switches matter at this size: sliding windows shorter than
the rollout, soft-caps small enough that ``tanh`` bends, partial rotary, multipliers far from 1, a larger
init so greedy decoding is not decided by near-ties.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

GREEDY_TOKENS = 100  # greedy tokens compared with model.generate per case (CPU, fp32)
LOGPROB_ATOL = 1e-5  # sampled log-probs against a fresh forward of the model
DROP = object()  # a case value that removes a common config key
# the attention a reference model with attention-logit soft-capping runs: the one that applies the cap
REFERENCE_ATTENTION = "eager"

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Case:
    """One tiny model of a family: its transformers classes, config overrides and what it exercises."""

    name: str
    config: str
    model: str
    kwargs: dict = field(default_factory=dict)
    exercises: str = ""
    # parameter names (suffixes) moved off their init like the biases: a switch that only matters when they
    # are not uniform (a q/k norm's weight, for the order of norm and rotation)
    perturb: tuple = ()


CASES = [
    Case("llama", "LlamaConfig", "LlamaForCausalLM", {}, "GQA, RMSNorm, SwiGLU"),
    Case("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": 24},
         "sliding window 24 on every layer"),
    Case("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}, "q/k/v biases"),
    Case("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {}, "per-head q/k RMSNorm"),
    Case("gemma", "GemmaConfig", "GemmaForCausalLM", {}, "embeddings x sqrt(hidden), (1+w) RMSNorm, GeGLU"),
    Case("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
         {"sliding_window": 24, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
          "final_logit_softcapping": 3.0},
         "sandwich norms, attention and final soft-capping, window 24 on alternate layers, query_pre_attn_scalar"),
    Case("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM",
         {"sliding_window": 24, "query_pre_attn_scalar": 24,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
         "q/k norms, window 24 with its own RoPE base (1e4 local, 1e6 global)"),
    Case("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}, "post-norm, q/k RMSNorm over the whole projection"),
    Case("olmo3", "Olmo3Config", "Olmo3ForCausalLM",
         {"sliding_window": 24,
          "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
         "OLMo-2's layer with window 24 on three of four layers, a RoPE base per layer type (1e4 / 1e6)"),
    Case("exaone4", "Exaone4Config", "Exaone4ForCausalLM",
         {"sliding_window": 24,
          "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
         "post-norm, per-head q/k norms, window 24 on three of four layers, no RoPE on the full layer"),
    Case("exaone4 (no window)", "Exaone4Config", "Exaone4ForCausalLM",
         {"sliding_window": None, "layer_types": ["full_attention"] * 4},
         "without a window every layer is rotated"),
    Case("cohere2", "Cohere2Config", "Cohere2ForCausalLM",
         {"sliding_window": 24, "logit_scale": 0.5,
          "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
         "one LayerNorm read by attention and MLP in parallel, RoPE over adjacent dims on the windowed layers "
         "only (window 24), logit scale 0.5"),
    Case("phi3", "Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "sliding_window": 24},
         "fused qkv_proj and gate_up_proj, partial rotary 0.5, window 24"),
    Case("phi", "PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5, "qk_layernorm": True},
         "attention and MLP in parallel on one LayerNorm (attn + mlp + x), biased projections, partial rotary 0.5, per-head q/k LayerNorm"),
    Case("phi (no q/k norm)", "PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.4, "initializer_range": 0.2},
         "Phi-2's form: qk_layernorm off, partial rotary 0.4 (init 0.2: at 0.1 its greedy tokens collapse)"),
    Case("helium", "HeliumConfig", "HeliumForCausalLM", {}, "Llama's layer, RoPE over adjacent dims (the table's first half, interleaved)"),
    Case("glm", "GlmConfig", "GlmForCausalLM", {"partial_rotary_factor": 0.5, "attention_bias": True},
         "adjacent-pair RoPE over half of each head, q/k/v biases, fused gate_up_proj"),
    Case("glm4", "Glm4Config", "Glm4ForCausalLM", {"partial_rotary_factor": 0.5, "attention_bias": True},
         "GLM's attention with sandwich norms (after attention and after the MLP)"),
    Case("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {"use_bias": True},
         "adjacent-pair RoPE, biases on every projection"),
    Case("olmo", "OlmoConfig", "OlmoForCausalLM", {"clip_qkv": 0.5}, "non-parametric LayerNorm, q/k/v clipped to 0.5"),
    Case("ministral", "MinistralConfig", "MinistralForCausalLM",
         {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"] * 2},
         "window 24 on alternate layers"),
    Case("nemotron", "NemotronConfig", "NemotronForCausalLM", {"partial_rotary_factor": 0.5},
         "LayerNorm1P (1 + w), partial rotary 0.5, ReLU-squared MLP"),
    Case("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", {"attention_bias": True, "attention_out_bias": True},
         "Llama's layer with biased q/k/v and o projections"),
    Case("arcee", "ArceeConfig", "ArceeForCausalLM", {}, "an ungated ReLU-squared MLP (up / down)"),
    Case("apertus", "ApertusConfig", "ApertusForCausalLM", {"max_position_embeddings": 65536},
         "per-head q/k RMSNorm, its own norm names, xIELU MLP, Llama-3 rotary scaling"),
    Case("hunyuan_v1_dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {},
         "per-head q/k RMSNorm after the rotary embedding (norm weights N(1, 0.1): with uniform ones the order would not matter)",
         perturb=("query_layernorm.weight", "key_layernorm.weight")),
    Case("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 24, "use_bias": True},
         "LayerNorm with bias, biased q/k/v/o, GELU MLP, window 24 on every layer"),
    Case("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
         {"rotary_pct": 0.25, "use_parallel_residual": True, "num_key_value_heads": DROP, "head_dim": DROP},
         "parallel residual, rotary on 25% of each head, LayerNorm with bias, per-head fused q/k/v"),
    Case("gpt_neox (sequential)", "GPTNeoXConfig", "GPTNeoXForCausalLM",
         {"rotary_pct": 0.25, "use_parallel_residual": False, "num_key_value_heads": DROP, "head_dim": DROP},
         "use_parallel_residual=False"),
    Case("granite", "GraniteConfig", "GraniteForCausalLM",
         {"embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
          "logits_scaling": 2.0},
         "embedding / residual / attention multipliers, logits scaling"),
    Case("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2},
         "no RoPE on every second layer"),
    Case("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [3]},
         "8 experts top-2, renormalised (routed decode over the model's router and experts), one dense layer, q/k norms"),
    Case("mixtral", "MixtralConfig", "MixtralForCausalLM",
         {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, "4 experts top-2"),
    Case("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
         {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 0.5},
         "8 experts top-2, not renormalised, q/k RMSNorm over the whole projection, q/k/v clipped to 0.5"),
    Case("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2},
         "OLMo-2's post-norm layer with 8 experts top-2 (not renormalised)"),
    Case("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 64, "mlp_only_layers": [3]},
         "8 experts top-2 and a sigmoid-gated shared expert, q/k/v biases, one dense layer"),
    Case("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
         {"num_local_experts": 8, "num_experts_per_tok": 2, "embedding_multiplier": 3.0,
          "residual_multiplier": 0.5, "attention_multiplier": 0.1, "logits_scaling": 2.0},
         "8 experts top-2 routed by the softmax of the top-2 logits (a `router`, in `block_sparse_moe`), Granite's multipliers"),
    Case("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
         {"num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
          "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
          "logits_scaling": 2.0},
         "granitemoe with an always-on shared MLP added to the routed output"),
]  # fmt: skip


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def build(c: Case, vocab_size: int, seed: int = 0, **overrides):
    """A random-init model of case ``c`` (fp32, eval mode), its generation config stopping at 2."""
    import torch
    import transformers

    # a copy: transformers' configs rewrite the dicts they are given in place (rope_parameters gains fields)
    kwargs = {**COMMON, **c.kwargs, **overrides, "vocab_size": vocab_size}
    kwargs = copy.deepcopy({k: v for k, v in kwargs.items() if v is not DROP})
    config = getattr(transformers, c.config)(**kwargs)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        # the reference must be the model's soft-capped forward: only eager attention applies the cap, and
        # transformers 5.17 runs Gemma-2 on sdpa by default, which drops it without a word (5.25 refuses it)
        config = getattr(transformers, c.config)(**kwargs, attn_implementation=REFERENCE_ATTENTION)
    torch.manual_seed(seed)
    model = getattr(transformers, c.model)(config).eval()
    # transformers initialises biases to 0: moved off it so a bias the static forward dropped or misplaced
    # changes the tokens (norm weights stay: moved too, some tiny models' greedy tokens collapse to one)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 2)  # every case keeps >= 8 distinct greedy tokens
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith(c.perturb):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


CHECKS = [
    f"greedy tokens equal `model.generate` for {GREEDY_TOKENS} tokens (5 left-padded prompts; CPU, fp32; "
    "a model with attention soft-capping runs eager attention there, the one transformers applies the cap in)",
    f"sampled log-probs (temperature 0.8, 40 tokens, past every window) within {LOGPROB_ATOL:g} of a forward "
    "of the model itself",
    "bf16 (CPU): the prefill's last-position logits equal the model's own forward bit for bit",
    "bf16 (CPU): every greedy token of 40 is the argmax of the model's own bf16 forward over the generated "
    "sequence, up to 2**-5 of the top logit or, in a routed MoE model, of its router's k-th expert at that "
    "position (exact equality with `generate` is a coin toss on near-ties)",
    'one PPO update (`PPOTrainer`, `rollout_backend="static"`) runs with it as the policy and changes it',
]
# what the engine does with models outside the table (rows rendered from choose_decode_path)
OUTSIDE = [
    ("gpt2", "GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 2, "n_head": 4}),
    ("phi3 with longrope", "Phi3Config", "Phi3ForCausalLM",
     {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8, "original_max_position_embeddings": 256}}),
]  # fmt: skip


def _outside_model(name: str, config: str, model: str, kwargs: dict, vocab_size: int):
    import transformers

    base = {} if name == "gpt2" else {**COMMON}
    return getattr(transformers, model)(
        getattr(transformers, config)(**copy.deepcopy({**base, **kwargs}), vocab_size=vocab_size)
    )


def render_models_md(vocab_size: int) -> str:
    """docs/models.md from :data:`CASES` and the engine's own verdicts (``choose_decode_path``)."""
    from test_generic_forward import FAMILIES as GENERIC_CASES

    from rapidfire_hf.rollout.engine import choose_decode_path
    from rapidfire_hf.rollout.families import FAMILIES

    def path_of(model) -> str:
        path, why = choose_decode_path(model)
        if path == "native":
            return "native"
        return f"generic (not native: {why})" if path == "generic" else f"fallback: {why}"

    lines = [
        "# Supported models",
        "",
        "<!-- generated by `python tests/rollout/family_cases.py` from tests/rollout/family_cases.py; "
        "tests/rollout/test_families.py fails when this file differs -->",
        "",
        "The rollout engine runs a model on its **native** path (the static-cache decode step of",
        "`rapidfire_hf/rollout/llama_forward.py`, one forward with per-family switches from",
        '`rollout/families.py`) when `unsupported_reason(model)` is None; `rollout_backend="auto"` then picks it',
        "on CUDA, and the start table says `rollout: static engine (native forward` (for a routed MoE model",
        "followed by how its experts run, below). Other decoder-only causal",
        "LMs run on the **generic** path: the model's own forward over the same static cache, compiled and",
        "recorded the same way (`rollout/generic_forward.py`; the start table says `generic path` and why not",
        "native). What neither runs falls back to `model.generate`, and the start table names both reasons.",
        "",
        "| case | model_type | path (`auto`, CUDA) | what the tiny model exercises |",
        "| --- | --- | --- | --- |",
    ]
    for c in CASES:
        model = build(c, vocab_size)
        lines.append(f"| {c.name} | `{model.config.model_type}` | {path_of(model)} | {c.exercises} |")
    for name, config, model_cls, kwargs in OUTSIDE:
        model = _outside_model(name, config, model_cls, kwargs, vocab_size)
        lines.append(f"| {name} | `{model.config.model_type}` | {path_of(model)} | (outside the table) |")
    lines += [
        "",
        f"Model types with a native decode: {', '.join(f'`{t}`' for t in FAMILIES)}.",
        "",
        "Model types checked on the generic path by `tests/rollout/test_generic_forward.py` (greedy tokens equal",
        '`model.generate` for 64 tokens, CPU fp32; native ones forced onto it with `decode_path="generic"`): '
        f"{', '.join(f'`{t}`' for t in GENERIC_CASES)}.",
        "",
        "Each case above is checked by `tests/rollout/test_families.py` on a tiny random-init model of the",
        "family (4 layers, hidden 64; init 0.1 so greedy decoding is not decided by near-ties; biases N(0, 0.1), not 0, so each one counts):",
        "",
        *[f"- {check}" for check in CHECKS],
        "",
        "`tests/rollout/test_families_gpu.py` repeats the greedy check on one GPU in bf16 and fp32 with the",
        "compiled, graph-recorded decode step (run by hand on a GPU machine; skipped in CI).",
        "",
        "A sliding-window layer whose window spans prompt + response runs as full attention; a shorter window",
        "keeps a ring of `window` KV-cache slots (a decode token at slot `s` goes to entry `s mod window`; the",
        "prefill stores the prompt's last `window` slots), so a local layer holds `min(window, P + R)` slots,",
        "as the memory planner counts them. `tests/rollout/test_sliding_ring.py` checks it with a window of 8:",
        "greedy tokens equal `model.generate` for 100 tokens (Mistral, Gemma-2, Gemma-3, Phi-3), prompts",
        "longer than the window, sampled log-probs, the allocated slots, and an int8 cache.",
        "",
        "A routed MoE layer (`qwen3_moe`, `mixtral`, `olmoe`, `flex_olmo`, `qwen2_moe`, `granitemoe`, `granitemoeshared`) decodes through the model's own router and stacked expert",
        "weights with no host round trip (`rollout/moe_decode.py`), in one of three forms: where the rows'",
        "(row, expert) pairs outnumber the experts (`B * k > E`), every expert on every row (dense); below",
        "that, one grouped GEMM over the pairs sorted by expert (`torch._grouped_mm`) where it records on a",
        "CUDA device (bf16, compute capability 9.x/10.x), else each row's top-k experts gathered. One H100,",
        "Qwen3-30B-A3B-shaped layers: batch 8 grouped 5.40 ms against gather 9.72 and dense 7.61; batch 64",
        "dense 8.90 against grouped 9.20 (`benchmarks/rollout/results/h100/moeform_2026-12-07`;",
        "`families.py --moe-form` forces one). `tests/rollout/test_moe_decode.py` checks each form against",
        "the model's own block. The start table's rollout line says it for the run's device, e.g.",
        "`routed MoE experts (8 of 128): dense from batch 17, below it the grouped GEMM`.",
        "",
        *_runs_section(vocab_size),
    ]
    return "\n".join(lines)


def _runs_section(vocab_size: int) -> list[str]:
    """Which rollout runs under each distributed engine and in a sweep, from the trainer's own choice
    (``ppo.rollout_phase.rollout_backend``) and the engine's path choice."""
    from types import SimpleNamespace

    from transformers import OPTConfig, OPTForCausalLM

    from rapidfire_hf.distributed import support_for
    from rapidfire_hf.ppo.rollout_phase import ZERO3_ROLLOUT, rollout_backend
    from rapidfire_hf.rollout.engine import choose_decode_path

    def trainer_rollout(engine: str) -> str:
        backend = rollout_backend(SimpleNamespace(rollout_backend="auto"), support_for(engine, 2))
        if backend == "hf":
            return f"`model.generate`: {ZERO3_ROLLOUT}"
        gather = "; the policy gathered once per rollout, resharded after it" if engine == "fsdp2" else ""
        return f"static engine, native or generic path as above{gather}"

    opt = OPTForCausalLM(OPTConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   ffn_dim=32, word_embed_proj_dim=16))  # fmt: skip
    opt_path, _ = choose_decode_path(opt)
    rows = [
        ("PPOTrainer, one GPU or DDP", trainer_rollout("ddp"), "the cases above"),
        ("PPOTrainer, FSDP2", trainer_rollout("fsdp2"),
         "`tests/distributed/test_ppo_fsdp2.py` (gloo, 1 and 2 processes, accelerate's FSDP2 plugin): greedy tokens "
         "equal the unsharded `model.generate` and engine, one all-gather per unit per rollout, one PPO update"),
        ("PPOTrainer, DeepSpeed ZeRO-3", trainer_rollout("deepspeed_zero3"),
         "`tests/distributed/test_ppo_zero3.py` (gloo, 1 and 2 processes, accelerate's DeepSpeed plugin, needs "
         "DeepSpeed), `rollout_backend='static'`: greedy tokens equal the unsharded `model.generate` and engine, one "
         "`GatheredParameters` and no per-module fetch per rollout, one PPO update"),
        ("PPOSweep, a family with a native decode", "one batched decode of every trial (native path)",
         "`tests/sweep/test_independence.py`"),
        ("PPOSweep, OPT (generic only)", f"one batched decode of every trial ({opt_path} path)",
         "`tests/sweep/test_generic_path.py`: each trial of a 2-trial sweep equals the trial alone (CPU fp32)"),
    ]  # fmt: skip
    return [
        '## Which rollout runs where (`rollout_backend="auto"`, CUDA)',
        "",
        "| run | rollout | checked by |",
        "| --- | --- | --- |",
        *[f"| {run} | {rollout} | {checked} |" for run, rollout, checked in rows],
        "",
        "In a sweep the trials' LoRA adapters are routed per row inside the decode, on either path; a model",
        "neither path runs decodes trial by trial with `model.generate`. LoRA targets that are GPT-2-style",
        "`Conv1D` layers are refused by the sweep (its routed adapters wrap `nn.Linear`); train such trials one at",
        "a time with `PPOTrainer(peft_config=...)`.",
        "",
    ]


if __name__ == "__main__":
    from pathlib import Path

    from rapidfire_hf.demo import build_char_tokenizer

    out = Path(__file__).resolve().parents[2] / "docs" / "models.md"
    out.write_text(render_models_md(len(build_char_tokenizer())))
    print(f"wrote {out}")
