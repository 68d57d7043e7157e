"""The ``model.generate`` backend, PEFT models, other architectures and backend selection."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy, no_default_eos

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams


def test_hf_backend_tokens_and_logprobs_equal_generate_scores(tokenizer, prompts):
    model = build_tiny_llama(tokenizer)
    model.lm_head.weight.data *= 4
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=8, top_p=0.9)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="hf")
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(3))
    # the same seed in HF's own sampler (its warpers, output_scores) must give the same draw
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(3)))
    torch.manual_seed(seed)
    with no_default_eos(model), torch.no_grad():
        hf = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=True,
            temperature=0.8,
            top_k=8,
            top_p=0.9,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert torch.equal(out.responses, hf.sequences[:, ids.shape[1] :])
    ref = torch.stack(hf.scores, 1).log_softmax(-1).gather(-1, out.responses[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    # init_lora_weights=False: a non-zero adapter, so a path that skipped it would be caught
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    return get_peft_model(model, cfg)


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_peft_lora_generation(tokenizer, prompts, backend):
    ids, mask = prompts
    base_ref = hf_greedy(build_tiny_llama(tokenizer), ids, mask, 12, stop=2)
    model = _lora(build_tiny_llama(tokenizer))
    model.train()
    ref = hf_greedy(model, ids, mask, 12, stop=2)
    assert not torch.equal(ref, base_ref)  # the adapter changes the output
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[2], backend=backend)
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    assert torch.equal(engine.generate(ids, mask, params).responses, ref)
    assert model.training
    with model.disable_adapter():  # the LoRA reference policy: base weights, same engine
        assert torch.equal(engine.generate(ids, mask, params).responses, base_ref)
    assert torch.equal(engine.generate(ids, mask, params).responses, ref)


def _tiny(model_type: str):
    import transformers

    cls = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=46,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return getattr(transformers, f"{cls}ForCausalLM")(config)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_other_llama_family_greedy_matches_generate(prompts, model_type):
    model = _tiny(model_type)
    ids, mask = prompts
    out = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static").generate(
        ids, mask, SamplingParams(max_new_tokens=16, do_sample=False)
    )
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 16, stop=None))


def test_unsupported_model_uses_hf_and_static_is_refused(prompts):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    # GPT-Neo: neither the native forward nor the generic path (no static-cache support in Transformers)
    config = GPTNeoConfig(
        vocab_size=46, hidden_size=32, num_layers=1, num_heads=2, attention_types=[[["global"], 1]]
    )
    model = GPTNeoForCausalLM(config)
    with pytest.raises(ValueError, match="backend='static' cannot run"):
        RolloutEngine(model, pad_token_id=0, backend="static")
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="auto")
    assert engine.backend == "hf"
    ids, mask = prompts
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=5, do_sample=False))
    assert out.responses.shape == (ids.shape[0], 5)
    with pytest.raises(ValueError, match="backend must be one of"):
        RolloutEngine(model, pad_token_id=0, backend="vllm-please")


def test_auto_on_cpu_is_hf_and_stops_default_to_eos(tokenizer):
    engine = RolloutEngine(build_tiny_llama(tokenizer), pad_token_id=0)
    assert engine.backend == "hf" and engine.stop_token_ids == [2]


def test_right_padded_prompts_are_rejected(tokenizer):
    ids = torch.tensor([[5, 6, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        RolloutEngine(build_tiny_llama(tokenizer), 0, backend="static").generate(
            ids, torch.tensor([[1, 1, 0]])
        )


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_no_stop_tokens_means_the_model_eos_is_ignored(tokenizer, prompts, backend):
    model = build_tiny_llama(tokenizer)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=20, do_sample=False)
    free = RolloutEngine(model, 0, [], backend="static").generate(ids, mask, params).responses
    model.generation_config.eos_token_id = int(free[0, 3])  # a token the first row emits early
    out = RolloutEngine(model, 0, [], backend=backend).generate(ids, mask, params)
    assert torch.equal(out.responses, free) and out.response_mask.all()
    assert model.generation_config.eos_token_id == int(free[0, 3])  # restored after the call
