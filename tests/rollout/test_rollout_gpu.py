"""The static engine on CUDA: every decode mode against ``model.generate`` (fp32, TF32 off) and a fresh forward."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import fresh_logits, hf_greedy

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture()
def cuda_setup(tokenizer, prompts):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_tiny_llama(tokenizer, heads=8, kv_heads=2).cuda()
    ids, mask = (x.cuda() for x in prompts)
    return model, ids, mask


@pytest.mark.parametrize("mode", ["eager", "cuda_graph", "compile"])
def test_greedy_matches_generate_on_cuda(cuda_setup, mode):
    model, ids, mask = cuda_setup
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode=mode)
    params = SamplingParams(max_new_tokens=100, do_sample=False)
    ref = hf_greedy(model, ids, mask, 100, stop=None)
    for _ in range(2):  # the second call replays the recorded graphs
        assert torch.equal(engine.generate(ids, mask, params).responses, ref)


@pytest.mark.parametrize("mode", ["eager", "cuda_graph"])
def test_sampled_logprobs_and_seed_on_cuda(cuda_setup, mode):
    model, ids, mask = cuda_setup
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[2], backend="auto", decode_mode=mode)
    assert engine.backend == "static"
    params = SamplingParams(max_new_tokens=70, temperature=0.8, top_k=20, top_p=0.95)
    a = engine.generate(ids, mask, params, generator=torch.Generator("cuda").manual_seed(0))
    b = engine.generate(ids, mask, params, generator=torch.Generator("cuda").manual_seed(0))
    c = engine.generate(
        ids, mask, params, generator=torch.Generator().manual_seed(0)
    )  # CPU generator works too
    assert torch.equal(a.responses, b.responses) and c.responses.shape == a.responses.shape
    from rapidfire_hf.rollout import process_logits

    logits = fresh_logits(model, a.sequences, mask)[:, a.prompt_length - 1 : -1]
    ref = process_logits(logits.flatten(0, 1), 0.8, 20, 0.95).view_as(logits).log_softmax(-1)
    ref = ref.gather(-1, a.responses[..., None]).squeeze(-1).masked_fill(~a.response_mask, 0.0)
    torch.testing.assert_close(a.logprobs, ref, atol=1e-4, rtol=0)


def test_lora_adapter_toggle_under_cuda_graphs(tokenizer, prompts):
    from peft import LoraConfig, get_peft_model

    torch.backends.cuda.matmul.allow_tf32 = False
    ids, mask = (x.cuda() for x in prompts)
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(build_tiny_llama(tokenizer).cuda(), cfg)
    engine = RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="cuda_graph"
    )
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    with_lora = engine.generate(ids, mask, params).responses
    with model.disable_adapter():
        base = engine.generate(ids, mask, params).responses
        assert torch.equal(base, hf_greedy(model, ids, mask, 40, stop=None))
    assert not torch.equal(with_lora, base)
    assert torch.equal(engine.generate(ids, mask, params).responses, with_lora)


def test_graphs_rerecorded_after_settings_and_shape_change(cuda_setup):
    """Greedy, then sampled, then a smaller batch, then greedy again on one engine: each change drops the
    recorded graphs and records new ones into a fresh pool (a stale pool handle broke the capture)."""
    model, ids, mask = cuda_setup
    engine = RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="cuda_graph"
    )
    greedy = SamplingParams(max_new_tokens=40, do_sample=False)
    ref = hf_greedy(model, ids, mask, 40, stop=None)
    assert torch.equal(engine.generate(ids, mask, greedy).responses, ref)
    engine.generate(
        ids, mask, SamplingParams(max_new_tokens=40), generator=torch.Generator("cuda").manual_seed(1)
    )
    small = engine.generate(ids[:2], mask[:2], greedy).responses
    assert torch.equal(small, hf_greedy(model, ids[:2], mask[:2], 40, stop=None))
    assert torch.equal(engine.generate(ids, mask, greedy).responses, ref)
