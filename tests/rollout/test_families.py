"""Every decoder family of the static engine against its own transformers model (CPU, fp32): greedy tokens
equal ``model.generate``, sampled log-probs equal a fresh forward, a PPO update runs with it as the policy;
and docs/models.md is the rendering of this table (family_cases.py)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from _rollout_helpers import argmax_misses, fresh_logits, hf_greedy
from family_cases import (
    CASES,
    GREEDY_TOKENS,
    LOGPROB_ATOL,
    REFERENCE_ATTENTION,
    build,
    case,
    render_models_md,
)

from rapidfire_hf.rollout import RolloutEngine, SamplingParams
from rapidfire_hf.rollout.engine import choose_decode_path
from rapidfire_hf.rollout.families import FAMILIES
from rapidfire_hf.rollout.llama_forward import unsupported_reason

NAMES = [c.name for c in CASES]
DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_generate(tokenizer, prompts, name):
    model = build(case(name), len(tokenizer))
    ids, mask = prompts
    ref = hf_greedy(model, ids, mask, GREEDY_TOKENS, stop=None)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native")
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=GREEDY_TOKENS, do_sample=False))
    assert torch.equal(out.responses, ref)
    # a meaningful comparison: the rows are not one repeated token
    assert len(set(ref.flatten().tolist())) >= 8


def test_soft_capped_references_run_the_attention_that_applies_the_cap(tokenizer, monkeypatch):
    """transformers 5.17 declares sdpa for Gemma-2 and picks it by default; its sdpa drops the attention
    soft-cap, so on one H100 the engine (capped, as the model is defined) left that ``generate`` at step 22
    with a top-2 gap of 0.057 (issue 45; the same tokens on the CPU with 5.17). The table's references
    with a cap run the attention that applies it, whatever transformers' default."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", True)  # as transformers 5.17 declares it
    capped = [c for c in CASES if getattr(build(c, len(tokenizer)).config, "attn_logit_softcapping", None)]
    assert [c.name for c in capped] == ["gemma2"]
    assert build(case("gemma2"), len(tokenizer)).config._attn_implementation == REFERENCE_ATTENTION


def test_the_engine_follows_a_models_attention_that_drops_its_soft_cap(tokenizer, prompts):
    """transformers 5.17's sdpa attention drops Gemma-2's attention soft-cap (the training forward then runs
    uncapped); the engine follows the model it was given, and says so once. Its sdpa forward is the eager one
    without the cap (this transformers refuses sdpa with a cap, so the uncapped eager model is the reference)."""
    ids, mask = prompts
    model = build(case("gemma2"), len(tokenizer), seed=1)
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capped = RolloutEngine(
            model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native"
        )
        capped_out = capped.generate(ids, mask, params)
    assert not [
        w for w in caught if "soft-capping" in str(w.message)
    ]  # eager applies the cap: nothing to say
    model.config._attn_implementation = "sdpa"  # what transformers 5.17 picks for Gemma-2 by default
    with pytest.warns(UserWarning, match=r"attn_implementation='sdpa'.*attn_logit_softcapping=2\.0.*'eager'"):
        engine = RolloutEngine(
            model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native"
        )
    out = engine.generate(ids, mask, params)
    reference = build(case("gemma2"), len(tokenizer), seed=1)
    for layer in reference.model.layers:  # sdpa's forward: the eager one without the attention cap
        layer.self_attn.attn_logit_softcapping = None
    assert torch.equal(out.responses, hf_greedy(reference, ids, mask, 40, stop=None))
    assert not torch.equal(out.responses, capped_out.responses)  # the cap matters on this model


@pytest.mark.parametrize("name", NAMES)
def test_sampled_logprobs_equal_forward(tokenizer, prompts, name):
    model = build(case(name), len(tokenizer), seed=1)
    ids, mask = prompts
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native")
    params = SamplingParams(max_new_tokens=40, temperature=0.8)  # prompt + 40 passes every window of 24
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
    logits = fresh_logits(model, out.sequences, mask)[:, out.prompt_length - 1 : -1]
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, out.responses[..., None]).squeeze(-1)
    assert (out.logprobs - ref).abs().max() <= LOGPROB_ATOL


@pytest.mark.parametrize("name", NAMES)
def test_bf16_greedy_tokens_are_the_models_argmax(tokenizer, prompts, name):
    """bf16 (each family's dtype flow: OLMo-2's fp32 rotary tables, Gemma's rounded embedding scale): exact
    equality with generate is a coin toss on near-tied logits, so every token must be the argmax of the
    model's own bf16 forward over the generated sequence, up to a few roundings of the top logit."""
    model = build(case(name), len(tokenizer)).to(torch.bfloat16)
    ids, mask = prompts
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native")
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=40, do_sample=False))
    misses, exact = argmax_misses(model, out, mask)
    assert not misses, "\n".join(misses)
    assert exact >= 0.95  # ties are the exception


def _off_argmax(model, out, mask, step: int):
    """``out`` with row 0's token at ``step`` replaced by the model's least likely one there."""
    logits = fresh_logits(model, out.sequences, mask)[0, out.prompt_length - 1 + step]
    sequences, responses = out.sequences.clone(), out.responses.clone()
    responses[0, step] = sequences[0, out.prompt_length + step] = logits.argmin()
    return dataclasses.replace(out, sequences=sequences, responses=responses)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_prefill_logits_equal_the_models_forward_bit_for_bit(tokenizer, prompts, name):
    """The static forward over the whole prompt in bf16 (CPU): the last position's logits equal the model's own
    forward bit for bit, so each family's order of operations is the model's, including the switches that
    only move rounding (Phi's ``attn + mlp + x`` against Cohere's ``x + attn + mlp``: swapped, the Phi cases'
    logits move by 0.016 and 0.063). fp32 is not compared bit for bit: there the two SDPA calls differ by up
    to 1e-6 (the greedy and log-prob checks above hold fp32)."""
    from rapidfire_hf.rollout.llama_forward import StaticLlama

    model = build(case(name), len(tokenizer)).to(torch.bfloat16)
    ids, mask = prompts
    net = StaticLlama(model, attention="matmul")
    k, v = net.new_cache(ids.shape[0], ids.shape[1] + 4, "cpu")
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cos, sin = net.rope_table(positions)
    with torch.no_grad():
        got = net.logits(net.prefill(ids, mask, cos, sin, k, v))
        ref = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    assert ref.dtype == torch.bfloat16  # the engine hands its sampler the bf16 logits upcast to fp32
    assert torch.equal(got, ref.float()), (got - ref.float()).abs().max().item()


def test_argmax_misses_names_a_token_off_the_argmax_unless_the_router_was_tied(tokenizer, prompts):
    """The bf16 check's one exemption beyond a logit tie (a routed MoE layer's near-tied router at that
    position) covers that case only: a token off the argmax with clear routing is named."""
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    for tied in (False, True):
        model = build(case("mixtral"), len(tokenizer))
        if tied:  # every expert's router row the same: every position's top-k is decided by rounding
            for layer in model.model.layers:
                layer.mlp.gate.weight.data[:] = layer.mlp.gate.weight.data[0]
        engine = RolloutEngine(
            model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native"
        )
        out = engine.generate(ids, mask, params)
        assert argmax_misses(model, out, mask)[0] == []
        misses, exact = argmax_misses(model, _off_argmax(model, out, mask, 2), mask)
        if tied:
            assert misses == [] and exact < 1.0
        else:
            assert misses and misses[0].startswith("row 0 step 2: ")
    model = build(case("llama"), len(tokenizer))  # no router: only the logit tie
    out = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static").generate(
        ids, mask, params
    )
    assert argmax_misses(model, _off_argmax(model, out, mask, 0), mask)[0][0].startswith("row 0 step 0: ")


@pytest.mark.parametrize("name", NAMES)
def test_ppo_update_runs_with_the_family_as_policy(tmp_path, tokenizer, name):
    from rapidfire_hf.demo import build_tiny_value_model, make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer

    policy = build(case(name), len(tokenizer))
    before = [p.detach().clone() for p in policy.parameters()]
    trainer = PPOTrainer(
        args=PPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_mini_batches=2,
            num_ppo_epochs=1,
            response_length=8,
            stop_token="eos",
            learning_rate=1e-3,
            max_steps=1,
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=3,
            num_sample_generations=0,
            rollout_backend="static",
        ),
        processing_class=tokenizer,
        model=policy,
        value_model=build_tiny_value_model(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(8),
    )
    trainer.train()
    assert trainer.roller.engine.backend == "static" and trainer.roller.engine.path == "native"
    assert trainer.state.global_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_every_family_has_a_case_and_runs_natively(tokenizer):
    assert {build(c, len(tokenizer)).config.model_type for c in CASES} == set(FAMILIES)
    for c in CASES:
        assert unsupported_reason(build(c, len(tokenizer))) is None, c.name


def test_the_configuration_doc_counts_the_native_families():
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert f"the static engine runs the {len(FAMILIES)} model types of `docs/models.md`" in text


def test_models_doc_is_rendered_from_the_cases(tokenizer):
    expected = render_models_md(len(tokenizer))
    assert DOC.read_text() == expected, "docs/models.md drifted: run `python tests/rollout/family_cases.py`"


def test_a_window_spanning_the_rollout_is_full_attention(tokenizer, prompts):
    from rapidfire_hf.rollout.kv_layout import band as _band

    model = build(case("gemma3_text"), len(tokenizer), sliding_window=512)
    ids, mask = prompts
    out = RolloutEngine(model, 0, [], backend="static", decode_path="native").generate(
        ids, mask, SamplingParams(max_new_tokens=30, do_sample=False)
    )
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 30, stop=None))
    valid = torch.ones(2, 64, dtype=torch.bool)
    assert _band(valid, torch.tensor([63]), 64, 64) is valid  # no mask op at all
    assert _band(valid, torch.tensor([63]), 8, 64).sum(-1).tolist() == [8, 8]  # slots 56..63


@pytest.mark.parametrize(
    ("name", "overrides", "says"),
    [
        ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("qwen3", {"layer_types": ["chunked_attention"] * 4}, "layer types ['chunked_attention']"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "dynamic"),
        ("mistral", {"sliding_window": 0}, "sliding_window=[0] is not a positive number"),
        ("olmo", {"clip_qkv": -1.0}, "clip_qkv=-1.0 is not a positive number"),
    ],
)
def test_what_the_native_path_cannot_run_is_refused_by_name(tokenizer, name, overrides, says):
    model = build(case(name), len(tokenizer), **overrides)
    assert says in unsupported_reason(model)
    if (
        choose_decode_path(model)[0] == "generic"
    ):  # the model's own forward runs it (tests/rollout/test_generic_forward.py), saying why
        engine = RolloutEngine(model, 0, [], backend="static")
        assert engine.path == "generic" and says in engine.path_reason
        return
    with pytest.raises(ValueError, match="backend='static' cannot run this model"):
        RolloutEngine(model, 0, [], backend="static")
    assert RolloutEngine(model, 0, [], backend="auto").backend == "hf"


@pytest.mark.parametrize(
    ("name", "remove", "says"),
    [
        ("phi", ("self_attn", "q_layernorm"), "lack ['q_layernorm']"),  # its config asks for q/k norms
        ("granitemoe", (None, "block_sparse_moe"), "lack ['block_sparse_moe']"),
        ("hunyuan_v1_dense", ("self_attn", "key_layernorm"), "lack ['key_layernorm']"),
    ],
)
def test_a_layer_without_a_module_its_family_names_is_refused_by_name(tokenizer, name, remove, says):
    model = build(case(name), len(tokenizer))
    parent, child = remove
    for layer in model.model.layers:
        delattr(getattr(layer, parent) if parent else layer, child)
    assert says in unsupported_reason(model)
    assert RolloutEngine(model, 0, [], backend="auto").backend == "hf"


def test_a_model_type_that_lies_about_its_layers_is_refused(tokenizer):
    model = build(case("llama"), len(tokenizer))
    model.config.model_type = "gemma2"  # Llama layers have no pre/post feed-forward norms
    assert "pre_feedforward_layernorm" in unsupported_reason(model)
    model = build(case("llama"), len(tokenizer))
    model.config.model_type = "gpt_neox"
    assert "final_layer_norm" in unsupported_reason(model)


@pytest.mark.parametrize(
    ("name", "native"), [("gemma3_text", True), ("qwen3_moe", True), ("mixtral", True), ("gpt2", False)]
)
def test_start_table_names_the_path_auto_takes_on_cuda(tokenizer, name, native):
    from types import SimpleNamespace

    from family_cases import OUTSIDE, _outside_model

    from rapidfire_hf.ppo.recipe.start_report import start_facts

    if native:
        policy = build(case(name), len(tokenizer))
    else:
        policy = _outside_model(*next(o for o in OUTSIDE if o[0] == name), len(tokenizer))
    args = SimpleNamespace(
        rollout_decode_mode="auto",
        rollout_decode_attention="auto",
        rollout_decode_sampler="torch",
        rollout_decode_fuse_projections="auto",
        rollout_decode_linear="torch",
        rollout_decode_fuse_lora=False,
        rollout_kv_cache_dtype="auto",
    )
    patches = SimpleNamespace(summary=lambda: {"compiled_layers": {}, "liger": False})
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    facts = start_facts(
        args, None, policy, False, opt, None, None, None, patches, "auto", torch.device("cuda")
    )
    if native:
        assert facts.rollout.startswith("rollout: static engine (native forward")
        assert ("routed MoE experts" in facts.rollout) == (name in ("qwen3_moe", "mixtral")), facts.rollout
    else:  # the generic path: the model's own forward over the engine's cache
        assert facts.rollout.startswith(
            "rollout: static engine (generic path: the model's own forward, model_type 'gpt2' is not one of"
        )


def test_a_step_that_cannot_be_compiled_or_recorded_falls_back_mode_by_mode(tokenizer, prompts, monkeypatch):
    """The MoE families call the model's own routed block in the step; where a transformers version routes
    with a data-dependent loop, compiling and recording fail: the engine warns and runs one mode down."""
    from rapidfire_hf.rollout.static_engine import StaticEngine

    model = build(case("qwen3_moe"), len(tokenizer))
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=20, do_sample=False)
    engine = RolloutEngine(model, 0, [], backend="static", decode_path="native", decode_mode="compile")
    tried = []
    real = StaticEngine._run_step

    def run_step(self, params, mode, t):
        tried.append(mode)
        if mode != "eager":
            raise RuntimeError(f"{mode} unsupported here")
        return real(self, params, mode, t)

    monkeypatch.setattr(StaticEngine, "_mode", lambda self, device: self.decode_mode)
    monkeypatch.setattr(StaticEngine, "_run_step", run_step)
    with pytest.warns(UserWarning) as caught:
        out = engine.generate(ids, mask, params)
    assert [str(w.message).split(" (")[0] for w in caught][:2] == [
        "torch.compile of the decode step failed",
        "recording the decode step failed",
    ]
    assert tried[:3] == ["compile", "cuda_graph", "eager"] and set(tried[3:]) == {"eager"}
    assert engine._static.decode_mode == "eager"
    # what ran and each fall back, for the run's view (PPOTrainer.run_state) and benchmark rows
    assert engine.decode_mode_ran == "eager"
    steps = [f.split(":")[0] for f in engine.decode_fallbacks]
    assert steps == ["compile -> cuda_graph", "cuda_graph -> eager"]
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 20, stop=None))


@pytest.mark.parametrize(
    ("name", "fuses"),
    [("gemma2", True), ("gemma3_text", True), ("olmo2", True), ("granite", True), ("smollm3", True),
     ("phi3", False), ("gpt_neox", False), ("qwen3_moe", False)],
)  # fmt: skip
def test_fused_projections_where_the_family_has_separate_ones(tokenizer, prompts, name, fuses):
    """q/k/v and gate/up concatenated for the families that project separately (OLMo-2's q/k norm then
    acts on a slice of the fused output); Phi-3 and GPT-NeoX already project in one matmul and MoE layers
    route their MLP, so they keep their modules and no copy is made."""
    from rapidfire_hf.rollout.llama_forward import fused_projection_bytes

    model = build(case(name), len(tokenizer))
    ids, mask = prompts
    engine = RolloutEngine(model, 0, [], backend="static", decode_path="native", decode_fuse_projections=True)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=60, do_sample=False))
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 60, stop=None))
    assert (engine.copy_bytes() > 0) == fuses
    assert engine.copy_bytes() == fused_projection_bytes(model)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("llama", None),
        ("gemma3_text", None),
        ("gemma2", "soft-capped attention dequantizes the cache it reads each step; not measured"),
    ],
)
def test_which_models_auto_may_give_an_8bit_cache(tokenizer, name, why):
    """``rollout_kv_cache_dtype="auto"`` may store the cache in int8 only where the native decode attention
    reads it in its kernel (memory.kv_choice): not Gemma-2's soft-capped attention, nor the generic path."""
    from rapidfire_hf.rollout.engine import eight_bit_cache_reason

    assert eight_bit_cache_reason(build(case(name), len(tokenizer))) == why


def test_a_generic_path_model_gets_no_8bit_cache_from_auto(tokenizer):
    from rapidfire_hf.rollout.engine import eight_bit_cache_reason
    from tests.sweep.test_generic_path import tiny_opt

    model = tiny_opt(tokenizer)
    assert choose_decode_path(model)[0] == "generic"
    assert eight_bit_cache_reason(model) == "the policy runs the engine's generic decode path"
