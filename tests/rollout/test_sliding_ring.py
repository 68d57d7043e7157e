"""Sliding-window layers keep a ring of ``window`` cache slots (rollout/llama_forward.py, ``sliding_cache="ring"``):
greedy tokens equal ``model.generate`` far past a small window, sampled log-probs equal a fresh forward, the
cache of a local layer really holds ``window`` slots, and the ring agrees with the full-length masked cache
(``sliding_cache="full"``) it replaced, with an 8-bit cache too. CPU, fp32, the family cases' tiny models."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import fresh_logits, hf_greedy
from family_cases import GREEDY_TOKENS, LOGPROB_ATOL, build, case
from torch.utils._python_dispatch import TorchDispatchMode

from rapidfire_hf.models.plumbing import layer_windows
from rapidfire_hf.rollout import RolloutEngine, SamplingParams
from rapidfire_hf.rollout.llama_forward import StaticLlama
from rapidfire_hf.rollout.static_engine import StaticEngine

WINDOW = 8  # far below prompt (32 slots) + 100 tokens: every local layer wraps its ring many times
INT8_ATOL = 5e-3  # test_kv_cache_dtype.LOGPROB_ATOL["int8"]
WINDOWED = ["mistral", "gemma2", "gemma3_text", "phi3"]
# real prompt lengths 1, 8 (exactly the window), 9 (one past it) and 33, left-padded
LONG_PROMPTS = ["x", "abcdefgh", "abcdefghi", "the quick brown fox jumps over ->"]


def _model(tokenizer, name: str, seed: int = 0):
    return build(case(name), len(tokenizer), seed=seed, sliding_window=WINDOW)


def _engine(model, **kw) -> RolloutEngine:
    return RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native", **kw
    )


def _long_prompts(tokenizer):
    enc = tokenizer(LONG_PROMPTS, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("name", WINDOWED)
def test_greedy_far_past_the_window_equals_generate(tokenizer, prompts, name):
    model = _model(tokenizer, name)
    ids, mask = prompts
    ref = hf_greedy(model, ids, mask, GREEDY_TOKENS, stop=None)
    out = _engine(model).generate(ids, mask, SamplingParams(max_new_tokens=GREEDY_TOKENS, do_sample=False))
    assert torch.equal(out.responses, ref)
    assert len(set(ref.flatten().tolist())) >= 8  # not one repeated token


@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_prompts_longer_than_the_window_left_padded(tokenizer, name):
    """Rows shorter than, equal to, one past and four times the window in one left-padded batch, the prompt
    not padded to a bucket (prompt_bucket=1: the longest row's prompt fills every slot): prefill stores only
    the last ``window`` slots of each ring, banded attention over the whole prompt."""
    model = _model(tokenizer, name)
    ids, mask = _long_prompts(tokenizer)
    assert ids.shape[1] > 4 * WINDOW and int(mask.sum(-1).min()) < WINDOW
    ref = hf_greedy(model, ids, mask, 60, stop=None)
    engine = StaticEngine(model, pad_token_id=0, stop_token_ids=[], prompt_bucket=1, path="native")
    with torch.no_grad():
        tokens, _ = engine.generate(ids, mask, SamplingParams(max_new_tokens=60, do_sample=False))
    assert torch.equal(tokens, ref)
    assert engine._buf.k[0].shape[2] == WINDOW  # the ring was used (layer 0 is local in both)


def test_a_chunked_prefill_fills_the_rings_row_by_row(tokenizer):
    """``prefill_rows``: each chunk writes its rows' rings through views of the cache (prompts longer than the
    window), the same tokens and cache as one prefill."""
    model = _model(tokenizer, "gemma2")
    ids, mask = _long_prompts(tokenizer)
    params = SamplingParams(max_new_tokens=30, do_sample=False)
    out = {}
    for rows in (None, 1):
        engine = StaticEngine(model, 0, [], path="native", prefill_rows=rows)
        with torch.no_grad():
            out[rows] = (engine.generate(ids, mask, params)[0], [k.clone() for k in engine._buf.k])
    assert torch.equal(out[None][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[None][1], out[1][1]))
    assert out[1][1][0].shape[2] == WINDOW


@pytest.mark.parametrize("name", WINDOWED)
def test_sampled_logprobs_past_the_window_equal_a_forward(tokenizer, name):
    model = _model(tokenizer, name, seed=1)
    ids, mask = _long_prompts(tokenizer)
    params = SamplingParams(max_new_tokens=40, temperature=0.8)
    out = _engine(model).generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
    logits = fresh_logits(model, out.sequences, mask)[:, out.prompt_length - 1 : -1]
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, out.responses[..., None]).squeeze(-1)
    assert (out.logprobs - ref).abs().max() <= LOGPROB_ATOL


@pytest.mark.parametrize("name", WINDOWED)
def test_a_local_layer_holds_window_slots(tokenizer, prompts, name):
    """The allocated cache: ``window`` slots per local layer, the whole rollout per global one; the engine's
    held bytes shrink by exactly the slots the ring saves, against the full-length cache."""
    model = _model(tokenizer, name)
    windows = layer_windows(model.config)
    assert any(windows)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=50, do_sample=False)
    engines = {}
    for sliding in ("ring", "full"):
        engines[sliding] = engine = StaticEngine(model, 0, [], path="native")
        engine.net.sliding_cache = sliding
        with torch.no_grad():
            engine.generate(ids, mask, params)
    length = 32 + 50  # the prompt bucket + the response
    for name_, buf in (("k", engines["ring"]._buf.k), ("v", engines["ring"]._buf.v)):
        got = [t.shape[2] for t in buf]
        assert got == [WINDOW if w else length for w in windows], name_
    assert {t.shape[2] for t in engines["full"]._buf.k} == {length}
    local = sum(1 for w in windows if w)
    per_slot = 2 * ids.shape[0] * model.config.num_key_value_heads * 16 * 4  # K and V, head_dim 16, fp32
    saved = engines["full"].held_bytes() - engines["ring"].held_bytes()
    assert saved == local * (length - WINDOW) * per_slot
    # a window spanning the whole rollout is plain full attention over the full-length cache
    wide = StaticLlama(build(case(name), len(tokenizer), sliding_window=length))
    assert {t.shape[2] for t in wide.new_cache(2, length, "cpu")[0]} == {length}


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_the_8bit_ring_gives_the_full_8bit_caches_tokens(tokenizer, prompts, name):
    """int8 with a ring against int8 over the full-length masked cache: the same quantized K/V, attended in
    another order (the scales ride in the same ring: ``[B, KV, window]``). The other order's fp32 rounding
    (~1e-7) moves a K/V element across an int8 rounding boundary now and then, so the log-probs are held to
    the 8-bit cache's own tolerance (tests/rollout/test_kv_cache_dtype.py; 7e-4 measured here), the tokens
    to equality."""
    model = _model(tokenizer, name)
    ids, mask = prompts
    params = SamplingParams(max_new_tokens=60, do_sample=False)
    out = {}
    for sliding in ("ring", "full"):
        engine = StaticEngine(model, 0, [], path="native", kv_cache_dtype="int8")
        engine.net.sliding_cache = sliding
        with torch.no_grad():
            out[sliding] = engine.generate(ids, mask, params)
        if sliding == "ring":
            assert engine._buf.k_scale[0].shape == (ids.shape[0], model.config.num_key_value_heads, WINDOW)
            assert engine._buf.k[0].dtype == torch.int8
    assert torch.equal(out["ring"][0], out["full"][0])
    assert (out["ring"][1] - out["full"][1]).abs().max() <= INT8_ATOL


class _Remainders(TorchDispatchMode):
    """Counts the ``remainder`` ops a decode step issues (each one a kernel of a recorded step)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is torch.ops.aten.remainder
        return func(*args, **(kwargs or {}))


def test_one_ring_entry_per_window_size_not_per_layer(tokenizer):
    """Every local layer of one window shares the step's ring entry ``slot mod window``: one remainder a
    step, however many layers have that window (Gemma-3-1B: 22 local layers of 26)."""
    net = StaticLlama(_model(tokenizer, "mistral"))
    assert sum(w == WINDOW for w in net.windows) >= 2
    b, length = 2, 4 * WINDOW
    k, v = net.new_cache(b, length, "cpu")
    cos, sin = net.rope_table(torch.arange(length).expand(b, length))
    step = 3 * WINDOW
    with torch.no_grad(), _Remainders() as ops:
        net.decode(
            torch.ones(b, dtype=torch.long),
            torch.tensor([step]),
            cos[:, :, step],
            sin[:, :, step],
            torch.ones(b, length, dtype=torch.bool),
            k,
            v,
        )
    assert ops.n == 2  # the entry, and the ring mask's (slot - j) mod window


def test_a_bad_sliding_cache_is_named(tokenizer):
    with pytest.raises(ValueError, match=r"sliding_cache must be one of \('ring', 'full'\), got 'rings'"):
        StaticLlama(_model(tokenizer, "mistral"), sliding_cache="rings")


@pytest.mark.parametrize("name", ["gemma3_text", "mistral", "llama"])
def test_the_planners_cache_bytes_are_the_engines(tokenizer, prompts, name):
    """The memory planner's KV term (``Workload.cache_row_bytes``, windows from PPOTrainer's and PPOSweep's own
    workload builders) is the static engine's allocated K/V, ring or not."""
    from types import SimpleNamespace

    from rapidfire_hf.ppo.recipe.planning import workload
    from rapidfire_hf.sweep.planning import SweepPlanner

    model = _model(tokenizer, name) if name != "llama" else build(case(name), len(tokenizer))  # no window
    ids, mask = prompts
    engine = StaticEngine(model, 0, [], path="native")
    with torch.no_grad():
        engine.generate(ids, mask, SamplingParams(max_new_tokens=50, do_sample=False))
    held = sum(t.numel() * t.element_size() for t in [*engine._buf.k, *engine._buf.v])
    b = ids.shape[0]
    args = SimpleNamespace(
        local_batch_size=b, local_mini_batch_size=b, per_device_train_batch_size=b, response_length=50,
        rollout_kv_cache_dtype=None,
    )  # fmt: skip
    work = workload(args, model, prompt_tokens=32, itemsize=4, cache_persists=True)
    assert work.held_cache_bytes(b) == held
    trials = [SimpleNamespace(args=args)]  # PPOSweep's planner: one trial of the same rows
    swept = SweepPlanner().workload(trials, 32, 50, b, model, static=True, itemsize=4)
    assert swept.held_cache_bytes(b) == held


def test_no_ring_is_counted_where_the_generic_path_runs(tokenizer):
    """A windowed Phi-3 with longrope runs the generic path (the model's own forward, full-length caches): the
    planner counts every slot there."""
    from family_cases import OUTSIDE

    from rapidfire_hf.rollout.llama_forward import ring_windows, unsupported_reason

    (longrope,) = [kw for name, *_, kw in OUTSIDE if name == "phi3 with longrope"]
    model = _model(tokenizer, "phi3")
    rope = dict(
        longrope["rope_parameters"], short_factor=[1.0] * 4, long_factor=[2.0] * 4
    )  # partial rotary 0.5
    generic = build(case("phi3"), len(tokenizer), sliding_window=WINDOW, rope_parameters=rope)
    assert unsupported_reason(generic) is not None and all(layer_windows(generic.config))
    assert ring_windows(model) == (WINDOW,) * 4 and ring_windows(generic) == ()


@pytest.fixture()
def no_tf32():
    """fp32 matmuls in fp32 on the GPU (the greedy comparisons with ``generate``)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("mode", ["compile", "cuda_graph"])
@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_ring_greedy_on_cuda(tokenizer, prompts, no_tf32, name, mode, attention):
    """The ring inside a compiled / recorded step (its entry and mask computed from the step tensor), with
    SDPA and the Triton kernel (which reads the whole ring): fp32 greedy tokens equal ``generate``, twice
    (the second call replays the recorded graphs)."""
    model = _model(tokenizer, name).cuda()
    ids, mask = (x.cuda() for x in prompts)
    engine = _engine(model, decode_mode=mode, decode_attention=attention)
    ref = hf_greedy(model, ids, mask, GREEDY_TOKENS, stop=None)
    for _ in range(2):
        got = engine.generate(ids, mask, SamplingParams(max_new_tokens=GREEDY_TOKENS, do_sample=False))
        assert torch.equal(got.responses, ref)
    assert engine._static._buf.k[0].shape[2] == WINDOW


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_the_8bit_ring_on_cuda(tokenizer, prompts, no_tf32, attention):
    """int8 ring against int8 full-length cache in the recorded step (Triton dequantizes inside the kernel)."""
    model = _model(tokenizer, "gemma3_text").cuda()
    ids, mask = (x.cuda() for x in prompts)
    out = {}
    for sliding in ("ring", "full"):
        engine = StaticEngine(model, 0, [], decode_mode="cuda_graph", attention=attention, path="native",
                              kv_cache_dtype="int8")  # fmt: skip
        engine.net.sliding_cache = sliding
        with torch.no_grad():
            out[sliding] = engine.generate(ids, mask, SamplingParams(max_new_tokens=60, do_sample=False))
    assert torch.equal(out["ring"][0], out["full"][0])
    assert (out["ring"][1] - out["full"][1]).abs().max() <= INT8_ATOL
