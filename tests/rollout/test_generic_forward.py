"""The generic decode path (rollout/generic_forward.py): the model's own forward over the static engine's cache.

CPU, fp32, tiny random-init models built from configs (no downloads). References: ``model.generate`` (greedy
tokens) and one plain forward over prompt + response (sampled log-probs).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from _rollout_helpers import hf_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from rapidfire_hf.rollout import RolloutEngine, SamplingParams, generation_mode
from rapidfire_hf.rollout.engine import choose_decode_path
from rapidfire_hf.rollout.generic_forward import GenericNet, generic_unsupported_reason
from rapidfire_hf.rollout.sampling import process_logits
from rapidfire_hf.rollout.static_engine import StaticEngine

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 96
# one small config per family; each differs from Llama in what its own forward does. Initialisation widths
# (and bloom's seed) chosen so greedy responses vary (>= 8 distinct tokens a row): at the default 0.02 a tiny
# gpt2 / bloom / falcon repeats one token whatever it attends to, and greedy equality then did not notice
# keys written one cache slot late (the sampled log-probs did)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
GQA_WINDOW = dict(
    SMALL, num_hidden_layers=4, num_key_value_heads=2, sliding_window=8
)  # 8 << prompt + response
FAMILIES = {
    # families without a native forward: "auto" runs them on the generic path
    "gpt2": dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.5
    ),  # absolute positions
    "phi": dict(SMALL, initializer_range=1.0),  # partial rotary, parallel attention/MLP, biased projections
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=1.5),  # ALiBi, no position ids
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.5),  # MQA
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, initializer_range=0.3),  # MQA, fused c_attn
    "opt": dict(
        SMALL, ffn_dim=128, word_embed_proj_dim=64, initializer_range=0.3
    ),  # learned positions, offset 2
    "cohere2": dict(GQA_WINDOW, initializer_range=0.3),  # sliding-window layers beside global ones
    "starcoder2": dict(GQA_WINDOW, initializer_range=0.8),  # a sliding window on every layer
    # native families, forced onto the generic path (decode_path="generic")
    "gemma2": dict(GQA_WINDOW, head_dim=16, final_logit_softcapping=5.0, initializer_range=0.03),
    "gpt_neox": dict(SMALL, initializer_range=0.5),
}
GREEDY_SEED = {"bloom": 1}
NEW_TOKENS = 64


def build(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, **{**FAMILIES.get(model_type, {}), **overrides})
    return AutoModelForCausalLM.from_config(cfg).eval()


def prompts(seed: int = 0, batch: int = 3, width: int = 11):
    """Left-padded prompts of different lengths (pad id 0), no row empty."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pads in enumerate([4, 0, 7][:batch]):
        mask[row, :pads] = 0
    return ids.masked_fill(mask == 0, 0), mask


def reference_logprobs(model, sequences, prompt_mask, params: SamplingParams) -> torch.Tensor:
    """Log-probs of the response tokens under the processed distribution, from one plain forward."""
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, prompt_mask.shape[1] :])], dim=1)
    kwargs = {"attention_mask": mask}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=sequences, **kwargs).logits.float()
    p = prompt_mask.shape[1]
    step_logits = logits[:, p - 1 : -1]
    scores = process_logits(
        step_logits.reshape(-1, step_logits.shape[-1]), params.temperature, params.top_k, params.top_p
    )
    logp = torch.log_softmax(scores, -1).view(*step_logits.shape)
    return logp.gather(-1, sequences[:, p:, None]).squeeze(-1)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_generic_greedy_equals_generate(model_type):
    model = build(model_type, seed=GREEDY_SEED.get(model_type, 0))
    ids, mask = prompts()
    native = choose_decode_path(model)[0] == "native"
    engine = RolloutEngine(
        model,
        pad_token_id=0,
        stop_token_ids=[],
        backend="static",
        decode_path="generic" if native else "auto",
    )
    assert engine.path == "generic" and ("decode_path" if native else "is not one of") in engine.path_reason
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False))
    ref = hf_greedy(model, ids, mask, NEW_TOKENS, None)
    assert torch.equal(out.responses, ref), (out.responses != ref).nonzero()[:5]
    # the responses depend on what the model attends to: not one repeated token per row
    assert min(len(set(row.tolist())) for row in ref) >= 8


# rotary scaling that depends on the length so far (native refuses it): the rollout runs past the original
# 32 positions, so the scaling changes inside it
LENGTH_DEPENDENT_ROPE = {
    "llama": dict(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, max_position_embeddings=32
    ),
    "phi3": dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 32,
        },
        max_position_embeddings=128,
        pad_token_id=0,
    ),  # fmt: skip
}


@pytest.mark.parametrize("model_type", sorted(LENGTH_DEPENDENT_ROPE))
def test_generic_runs_length_dependent_rope(model_type):
    model = build(
        model_type, **SMALL, num_key_value_heads=2, initializer_range=0.3, **LENGTH_DEPENDENT_ROPE[model_type]
    )
    ids, mask = prompts()
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static")
    assert engine.path == "generic" and "length-dependent rotary scaling" in engine.path_reason
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False))
    ref = hf_greedy(model, ids, mask, NEW_TOKENS, None)
    assert torch.equal(out.responses, ref)
    assert min(len(set(row.tolist())) for row in ref) >= 8


@pytest.mark.parametrize("model_type", ["gpt2", "cohere2", "bloom"])
def test_generic_sampled_logprobs_match_forward(model_type):
    # moderate weights: at bloom's 1.5 the logits are large enough that fp32 rounding alone (one forward over
    # the whole sequence against a token at a time) moves a log-prob by 5e-5
    model = build(model_type, seed=1, initializer_range=0.2)
    ids, mask = prompts(seed=1)
    params = SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="generic")
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(5))
    ref = reference_logprobs(model, out.sequences, mask, params)
    assert torch.isfinite(out.logprobs).all()
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)
    # the same seed draws the same tokens (the noise comes from the caller's generator)
    again = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(5))
    assert torch.equal(again.responses, out.responses)


def _static(model, path: str):
    return StaticEngine(model, 0, [], decode_mode="eager", path=path)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_generic_equals_native(model_type):
    """On a family both paths run, the generic path samples the native path's tokens with its log-probs."""
    extra = dict(SMALL, num_key_value_heads=2, initializer_range=0.3) if model_type == "llama" else {}
    model = build(model_type, **extra)
    ids, mask = prompts(seed=2)
    assert RolloutEngine(model, pad_token_id=0, backend="static").path == "native"  # "auto" picks native
    native, generic = _static(model, "native"), _static(model, "generic")
    assert isinstance(generic.net, GenericNet) and not isinstance(native.net, GenericNet)
    for params in (
        SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False),
        SamplingParams(max_new_tokens=32),
    ):
        with generation_mode(model):
            tn, ln = native.generate(ids, mask, params, torch.Generator().manual_seed(9))
            tg, lg = generic.generate(ids, mask, params, torch.Generator().manual_seed(9))
        assert torch.equal(tn, tg)
        torch.testing.assert_close(lg, ln, atol=1e-5, rtol=0)
    ref = hf_greedy(model, ids, mask, NEW_TOKENS, None)
    with generation_mode(model):
        assert torch.equal(
            generic.generate(ids, mask, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False))[0], ref
        )


def test_generic_stops_chunked_prefill_and_lora():
    """Stop tokens pad the rest; a chunked prefill fills the cache as one; LoRA layers run inside the forward."""
    from peft import LoraConfig, get_peft_model

    model = build("gpt2", seed=3)
    ids, mask = prompts(seed=3)
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    whole = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static").generate(
        ids, mask, params
    )
    chunked = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", prefill_chunk_rows=1)
    assert torch.equal(chunked.generate(ids, mask, params).responses, whole.responses)
    stop = int(whole.responses[1, 5])  # a token row 1 emits at its sixth step
    stopped = RolloutEngine(model, pad_token_id=0, stop_token_ids=[stop], backend="static").generate(
        ids, mask, params
    )
    assert torch.equal(stopped.responses, hf_greedy(model, ids, mask, 40, stop))
    assert not stopped.response_mask[1, 6:].any() and (stopped.logprobs[1, 6:] == 0).all()

    peft_model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False)
    ).eval()
    engine = RolloutEngine(peft_model, pad_token_id=0, stop_token_ids=[], backend="static")
    lora = engine.generate(ids, mask, params).responses
    assert engine.path == "generic"
    assert torch.equal(lora, hf_greedy(peft_model, ids, mask, 40, None))
    assert not torch.equal(lora, whole.responses)  # the adapter changes the tokens: it ran


def test_fallback_says_why():
    """A model the generic path cannot run falls back to model.generate under "auto", with the reason;
    "static" refuses with it."""
    from transformers import T5Config, T5ForConditionalGeneration

    enc_dec = T5ForConditionalGeneration(
        T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    )
    path, why = choose_decode_path(enc_dec)
    assert path is None and "encoder-decoder" in why and "native:" in why
    no_static = build("gpt_neo", hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]])
    assert "_can_compile_fullgraph=False" in generic_unsupported_reason(no_static)
    eager_fa = build("gpt2", attn_implementation="sdpa")
    eager_fa.config._attn_implementation = "flash_attention_2"
    assert "attn_implementation 'flash_attention_2'" in generic_unsupported_reason(eager_fa)
    with pytest.raises(ValueError, match="_can_compile_fullgraph"):
        RolloutEngine(no_static, pad_token_id=0, backend="static")
    # PPOTrainer's settings check: rollout_backend="static" refused for it, accepted for a generic-path model
    from types import SimpleNamespace

    from rapidfire_hf.ppo.settings_check import static_engine_refusal

    static = SimpleNamespace(rollout_backend="static")
    (refusal,) = static_engine_refusal(static, no_static)
    assert "native: model_type 'gpt_neo'" in str(refusal) and "generic: GPTNeoForCausalLM" in str(refusal)
    assert static_engine_refusal(static, build("gpt2")) == []
    engine = RolloutEngine(no_static, pad_token_id=0, stop_token_ids=[], backend="auto")
    assert engine.path == "model.generate" and "_can_compile_fullgraph" in engine.path_reason
    ids, mask = prompts()
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))
    assert torch.equal(out.responses, hf_greedy(no_static, ids, mask, 8, None))


def test_generic_warns_about_native_only_options():
    model = build("gpt2")
    with pytest.warns(UserWarning, match="decode_attention='matmul'.*native decode path only"):
        RolloutEngine(model, pad_token_id=0, backend="static", decode_attention="matmul")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutEngine(model, pad_token_id=0, backend="static")


@pytest.mark.usefixtures("no_rapidfire_env")
def test_ppo_update_with_a_generic_policy(tmp_path, tokenizer, capsys):
    """PPO end to end on a GPT-2 policy: the rollout runs the generic path and the start table says so."""
    from rapidfire_hf.demo import build_tiny_value_model, make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOTrainer
    from tests.ppo.helpers import ppo_args

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "gpt2", vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128
        )
    )
    policy.generation_config.pad_token_id, policy.generation_config.eos_token_id = 0, 2
    trainer = PPOTrainer(
        args=ppo_args(tmp_path, rollout_backend="static", max_steps=1),
        processing_class=tokenizer,
        model=policy,
        value_model=build_tiny_value_model(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
    )
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trainer.train()
    out = capsys.readouterr().out
    assert (
        "rollout: static engine (generic path: the model's own forward, model_type 'gpt2' is not one of"
        in out
    )
    engine = trainer.roller.engine
    assert engine.backend == "static" and engine.path == "generic"
    logs = [h for h in trainer.state.log_history if "objective/kl" in h]
    assert logs and all(v == v for v in logs[-1].values() if isinstance(v, float))  # no NaN
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())


def test_forced_decode_path_refuses_what_it_cannot_run():
    gpt2 = build("gpt2")
    with pytest.raises(ValueError, match="decode_path='native' cannot run this model .model_type 'gpt2'"):
        RolloutEngine(gpt2, pad_token_id=0, backend="static", decode_path="native")
    with pytest.raises(ValueError, match="decode_path must be one of"):
        RolloutEngine(gpt2, pad_token_id=0, backend="static", decode_path="fast")
    neo = build("gpt_neo", hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]])
    with pytest.raises(
        ValueError, match="decode_path='generic' cannot run this model .*_can_compile_fullgraph"
    ):
        RolloutEngine(neo, pad_token_id=0, backend="static", decode_path="generic")
    with pytest.warns(UserWarning, match="decode_path='generic' apply to the static engine only"):
        RolloutEngine(gpt2, pad_token_id=0, backend="hf", decode_path="generic")


def test_a_forward_that_fails_is_said_in_one_line():
    """Attack: a model whose own forward cannot run (a projection of the wrong width) is refused by a
    ValueError naming the failure, not a traceback from inside the engine's step."""
    model = build("gpt2")
    model.transformer.h[0].attn.c_attn = torch.nn.Linear(64, 5)
    with pytest.raises(
        ValueError, match="the model.s own forward failed on one token .ValueError: not enough values"
    ):
        RolloutEngine(model, pad_token_id=0, backend="static")
    bad_window = build("starcoder2", sliding_window=0)
    assert "sliding_window=0 is not a positive number" in generic_unsupported_reason(bad_window)
