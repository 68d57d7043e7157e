"""Every family of tests/rollout/family_cases.py on one GPU with the decode step the engine runs there
(compiled, or recorded as a CUDA graph): fp32 greedy tokens equal ``model.generate`` (TF32 off); in bf16,
where a random-init model's near-tied logits make exact equality a coin toss, every greedy token is the
argmax of the model's own forward over the generated sequence up to a few bf16 roundings of the top logit."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import fresh_logits, hf_greedy
from family_cases import CASES, GREEDY_TOKENS, build, case

from rapidfire_hf.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu
NAMES = [c.name for c in CASES]
# bf16 keeps 8 significant bits (2**-8 relative); the engine's kernels and HF's round differently through
# every layer, so a choice within a few roundings of the top logit is a tie, not an error
BF16_TIE = 2**-5


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("mode", ["compile", "cuda_graph"])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_greedy_equals_generate_on_cuda(tokenizer, prompts, name, mode):
    model = build(case(name), len(tokenizer)).cuda()
    ids, mask = (x.cuda() for x in prompts)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="auto", decode_mode=mode)
    assert engine.backend == "static" and engine.path == "native"  # "auto" runs the native forward
    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, do_sample=False)
    ref = hf_greedy(model, ids, mask, GREEDY_TOKENS, stop=None)
    for _ in range(2):  # the second call replays the recorded graphs
        assert torch.equal(engine.generate(ids, mask, params).responses, ref)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_greedy_tokens_are_the_models_argmax_on_cuda(tokenizer, prompts, name):
    model = build(case(name), len(tokenizer)).cuda().to(torch.bfloat16)
    ids, mask = (x.cuda() for x in prompts)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="auto")
    assert engine.path == "native"
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=GREEDY_TOKENS, do_sample=False))
    logits = fresh_logits(model, out.sequences, mask)[:, out.prompt_length - 1 : -1]
    chosen = logits.gather(-1, out.responses[..., None]).squeeze(-1)
    top = logits.max(-1).values
    assert ((top - chosen) <= BF16_TIE * top.abs().clamp_min(1.0)).all()
    assert (chosen == top).float().mean() >= 0.95  # ties are the exception
