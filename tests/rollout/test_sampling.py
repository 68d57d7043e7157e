"""Sampling: the distribution (chi-square), and top-k / top-p equal to HF's processed scores."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import fresh_logits, no_default_eos
from scipy.stats import chisquare

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams, process_logits

DRAWS = 4000


def _first_token_counts(engine, ids, mask, params, seed):
    batch_ids, batch_mask = ids.expand(DRAWS, -1), mask.expand(DRAWS, -1)
    out = engine.generate(batch_ids, batch_mask, params, generator=torch.Generator().manual_seed(seed))
    return torch.bincount(out.responses[:, 0], minlength=engine.model.config.vocab_size).double()


def _chi2_pvalue(counts, probs):
    # pool the bins expected below 5 draws into one so the chi-square approximation holds
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue


@pytest.mark.parametrize(
    "params", [SamplingParams(1, temperature=0.3), SamplingParams(1, temperature=0.5, top_k=5, top_p=0.8)]
)
def test_first_token_distribution_matches_softmax(tokenizer, params):
    model = build_tiny_llama(tokenizer, seed=5)
    # sharper logits than the random init gives, so a wrong sampler is easy to tell apart
    model.lm_head.weight.data *= 8
    enc = tokenizer(["task: hello ->"], return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static")
    counts = _first_token_counts(engine, ids, mask, params, seed=0)
    logits = fresh_logits(model, ids, mask)[:, -1]
    probs = process_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)[0]
    assert (counts[probs == 0] == 0).all()  # filtered tokens are never drawn
    assert _chi2_pvalue(counts, probs) > 1e-3
    # the test has power: the untempered softmax is rejected on the same draws
    assert _chi2_pvalue(counts, logits.softmax(-1)[0]) < 1e-6


@pytest.mark.parametrize("top_k,top_p", [(10, 1.0), (0, 0.7), (8, 0.9)])
def test_process_logits_equals_hf_processed_scores(tokenizer, prompts, top_k, top_p):
    model = build_tiny_llama(tokenizer)
    model.lm_head.weight.data *= 4
    ids, mask = prompts
    torch.manual_seed(0)
    with no_default_eos(model), torch.no_grad():
        hf = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=True,
            temperature=0.8,
            top_k=top_k,
            top_p=top_p,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    hf_scores = torch.stack(hf.scores, 1)  # [B, 6, V]
    logits = fresh_logits(model, hf.sequences, mask)[:, ids.shape[1] - 1 : -1]
    ours = process_logits(logits.flatten(0, 1), 0.8, top_k, top_p).view_as(hf_scores)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf_scores))
    assert torch.isinf(hf_scores).any()
    finite = ~torch.isinf(hf_scores)
    torch.testing.assert_close(ours[finite], hf_scores[finite], atol=1e-5, rtol=0)


def test_static_logprobs_are_filtered_logprobs(tokenizer, prompts):
    model = build_tiny_llama(tokenizer)
    model.lm_head.weight.data *= 4
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=8, top_p=0.9)
    out = RolloutEngine(model, 0, [], backend="static").generate(
        ids, mask, params, torch.Generator().manual_seed(1)
    )
    logits = fresh_logits(model, out.sequences, mask)[:, out.prompt_length - 1 : -1]
    scores = process_logits(logits.flatten(0, 1), 0.8, 8, 0.9).view_as(logits)
    ref = scores.log_softmax(-1).gather(-1, out.responses[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)
