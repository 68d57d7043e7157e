"""The generic decode path on one GPU, with the step the engine runs there (compiled, or recorded as a CUDA
graph): fp32 greedy tokens equal ``model.generate`` (TF32 off) and sampled log-probs match a forward of the
model, with no fall back to a lower decode mode (the engine warns when compiling or recording fails)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _rollout_helpers import hf_greedy
from test_generic_forward import GREEDY_SEED, build, prompts, reference_logprobs

from rapidfire_hf.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu
GENERIC_ONLY = ["gpt2", "phi", "bloom", "falcon", "gpt_bigcode", "opt", "cohere2", "starcoder2"]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("mode", ["compile", "cuda_graph"])
@pytest.mark.parametrize("model_type", GENERIC_ONLY)
def test_generic_fp32_greedy_equals_generate_on_cuda(model_type, mode):
    model = build(model_type, seed=GREEDY_SEED.get(model_type, 0)).cuda()
    ids, mask = (x.cuda() for x in prompts())
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="auto", decode_mode=mode)
    assert engine.backend == "static" and engine.path == "generic"  # "auto" runs the generic path on CUDA
    params = SamplingParams(max_new_tokens=100, do_sample=False)
    ref = hf_greedy(model, ids, mask, 100, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile or record failure would warn and run a lower mode
        for _ in range(2):  # the second call replays the recorded graphs
            assert torch.equal(engine.generate(ids, mask, params).responses, ref)


@pytest.mark.parametrize("model_type", ["gpt2", "cohere2"])
def test_generic_sampled_logprobs_on_cuda(model_type):
    model = build(model_type, seed=1, initializer_range=0.2).cuda()
    ids, mask = (x.cuda() for x in prompts(seed=1))
    params = SamplingParams(max_new_tokens=40, temperature=0.7)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="auto", decode_mode="compile")
    out = engine.generate(ids, mask, params, generator=torch.Generator("cuda").manual_seed(3))
    ref = reference_logprobs(model, out.sequences, mask, params)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)
