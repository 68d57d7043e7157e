"""The project's Triton decode kernels against their PyTorch references (interpreted on a CPU).

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU, so these run everywhere Triton is
installed (the ``test`` extra installs it); the GPU tests at the end run the compiled kernels in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rapidfire_hf.demo import build_tiny_llama  # noqa: E402
from rapidfire_hf.kernels import gqa_decode_attention  # noqa: E402
from rapidfire_hf.kernels.decode_attention import triton_unavailable_reason  # noqa: E402
from rapidfire_hf.kernels.triton_flash_decode import flash_decode, num_splits  # noqa: E402
from rapidfire_hf.kernels.triton_sampling import fused_sample  # noqa: E402
from rapidfire_hf.rollout import RolloutEngine, SamplingParams  # noqa: E402
from rapidfire_hf.rollout.sampling import philox_seeds, sample_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attention_inputs(b, kv, group, length, d, seed=0, p_valid=0.7):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kv, group, d, generator=g)
    k = torch.randn(b, kv, length, d, generator=g)
    v = torch.randn(b, kv, length, d, generator=g)
    valid = torch.rand(b, length, generator=g) < p_valid
    valid[:, -1] = True
    return [t.to(DEVICE) for t in (q, k, v, valid)]


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize(
    "b,kv,group,length,d", [(3, 2, 4, 37, 16), (1, 1, 8, 5, 8), (4, 4, 1, 150, 32), (2, 2, 8, 300, 64)]
)
def test_flash_decode_matches_matmul_reference_fp32(b, kv, group, length, d, splits):
    q, k, v, valid = _attention_inputs(b, kv, group, length, d)
    out = flash_decode(q, k, v, valid, d**-0.5, splits)
    ref = gqa_decode_attention(q, k, v, valid, d**-0.5, "matmul")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_flash_decode_reads_a_length_slice_of_a_larger_cache():
    q, k, v, valid = _attention_inputs(2, 2, 4, 200, 32, seed=1)
    n = 130  # the engine attends over cache[:, :, :kv_len]: a strided view
    out = flash_decode(q, k[:, :, :n], v[:, :, :n], valid[:, :n], 0.2, splits=4)
    ref = gqa_decode_attention(q, k[:, :, :n], v[:, :, :n], valid[:, :n], 0.2, "matmul")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_a_split_without_valid_slots_weighs_nothing():
    # only the last 10 slots are valid: the first splits see no key at all (their max stays -inf)
    q, k, v, valid = _attention_inputs(2, 1, 4, 256, 16, seed=2)
    valid[:] = False
    valid[:, -10:] = True
    out = flash_decode(q, k, v, valid, 0.25, splits=4)
    ref = gqa_decode_attention(q, k, v, valid, 0.25, "matmul")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("splits,end", [(1, 37), (4, 37), (4, 150), (None, 180)])
def test_kv_end_reads_no_slot_past_it_and_changes_no_bit(splits, end):
    # slots at and past kv_end are invalid and hold NaN: read there (even masked) they would reach the
    # output through p @ V (0 * NaN); bounded, the result is bit-identical to the unbounded run on clean slots
    q, k, v, valid = _attention_inputs(3, 2, 4, 200, 16, seed=6)
    valid[:, end:] = False
    valid[:, end - 1] = True
    clean = flash_decode(q, k, v, valid, 0.25, splits)
    k[:, :, end:], v[:, :, end:] = float("nan"), float("nan")
    kv_end = torch.tensor([end], device=DEVICE)
    out = flash_decode(q, k, v, valid, 0.25, splits, kv_end=kv_end)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)
    assert torch.isnan(flash_decode(q, k, v, valid, 0.25, splits)).any()  # the poison is real
    ref = gqa_decode_attention(q[..., :], k[:, :, :end], v[:, :, :end], valid[:, :end], 0.25, "matmul")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    through = gqa_decode_attention(q, k, v, valid, 0.25, "triton", kv_end)  # the default split count
    assert torch.equal(through, flash_decode(q, k, v, valid, 0.25, kv_end=kv_end))
    for bad in (torch.tensor([end, end]), torch.tensor([end + 0.7]), torch.tensor([True])):
        with pytest.raises(ValueError, match="one integer slot count"):
            flash_decode(q, k, v, valid, 0.25, kv_end=bad.to(DEVICE))


def test_the_engine_bounds_triton_attention_by_the_step_slot(tokenizer, monkeypatch):
    import rapidfire_hf.rollout.llama_forward as llama_forward

    seen = []
    real = llama_forward.gqa_decode_attention

    def spy(q, k, v, valid, scale, impl, kv_end=None):
        last = int(valid.any(0).nonzero().max()) + 1  # one past the last slot any row may see
        seen.append((impl, None if kv_end is None else int(kv_end), last))
        return real(q, k, v, valid, scale, impl, kv_end)

    monkeypatch.setattr(llama_forward, "gqa_decode_attention", spy)
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=6, temperature=0.8)
    _engine(tokenizer, decode_attention="triton").generate(
        ids, mask, params, torch.Generator().manual_seed(1)
    )
    layers = build_tiny_llama(tokenizer).config.num_hidden_layers
    steps = [s for s in seen if s[0] == "triton"]
    assert len(steps) == layers * 5  # 6 tokens: the first comes from the prefill
    ends = sorted({s[1] for s in steps})
    assert ends == list(range(ends[0], ends[0] + 5))  # one slot further each step
    assert all(end == last for _, end, last in steps)  # exactly the last valid slot + 1
    seen.clear()
    _engine(tokenizer).generate(ids, mask, params, torch.Generator().manual_seed(1))
    assert seen and all(s[1] is None for s in seen)  # SDPA reads the cache it is given


def test_num_splits_fills_the_device_and_never_exceeds_the_blocks():
    device = torch.device(DEVICE)
    assert num_splits(256, 4, 512, device) == 1 or DEVICE == "cpu"
    assert num_splits(1, 1, 40, device) == 1  # one 64-slot block: nothing to split
    assert num_splits(1, 1, 4096, device) > 1


def test_impl_triton_goes_through_gqa_decode_attention():
    q, k, v, valid = _attention_inputs(2, 2, 4, 70, 16, seed=3)
    out = gqa_decode_attention(q, k, v, valid, 0.25, "triton")
    torch.testing.assert_close(
        out, gqa_decode_attention(q, k, v, valid, 0.25, "matmul"), atol=2e-6, rtol=2e-6
    )


def _logits(b, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, vocab, generator=g) * 3).to(DEVICE), torch.rand(b, vocab, generator=g).to(DEVICE)


@pytest.mark.parametrize("vocab", [50, 5000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("do_sample", [True, False])
def test_fused_sample_draws_what_sample_tokens_draws(vocab, temperature, do_sample):
    logits, noise = _logits(6, vocab)
    params = SamplingParams(do_sample=do_sample, temperature=temperature)
    ref_tok, ref_lp = sample_tokens(logits, params, noise if do_sample else None)
    tok, lp = fused_sample(logits, temperature, do_sample, noise if do_sample else None)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, atol=3e-6, rtol=1e-6)


def test_fused_sample_philox_is_reproducible_per_step_and_draws_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 4000 if DEVICE == "cuda" else 400  # the interpreter runs ~15 ms per row
    logits = probs.log().repeat(rows, 1).to(DEVICE)
    seeds = philox_seeds(torch.Generator().manual_seed(0), rows, DEVICE)
    step = torch.tensor([3], device=DEVICE)
    tok, lp = fused_sample(logits, 1.0, True, seeds=seeds, step=step)
    again, _ = fused_sample(logits, 1.0, True, seeds=seeds, step=step)
    later, _ = fused_sample(logits, 1.0, True, seeds=seeds, step=step + 1)
    assert torch.equal(tok, again) and not torch.equal(tok, later)
    freq = torch.bincount(tok.cpu(), minlength=4).double() / rows
    sigma = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert ((freq - probs.double()).abs() < 4 * sigma).all(), freq
    torch.testing.assert_close(lp.cpu(), probs.log()[tok.cpu()], atol=1e-6, rtol=1e-6)


def test_fused_sample_refuses_what_it_cannot_do():
    logits, noise = _logits(2, 10)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fused_sample(logits, 0.0, True, noise)
    with pytest.raises(ValueError, match="exactly one of"):
        fused_sample(logits, 1.0, True)
    with pytest.raises(ValueError, match="exactly one of"):
        fused_sample(logits, 1.0, True, noise, seeds=torch.zeros(2, dtype=torch.long, device=DEVICE))


def _engine(tokenizer, **kwargs):
    model = build_tiny_llama(tokenizer).to(DEVICE)
    return RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="eager", **kwargs
    )


def _prompts():
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [0, 9, 8, 7, 6]], device=DEVICE)
    return ids, (ids != 0).long()


def test_engine_with_triton_kernels_generates_what_the_torch_path_generates(tokenizer):
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=12, temperature=0.8)
    ref = _engine(tokenizer).generate(ids, mask, params, torch.Generator().manual_seed(1))
    out = _engine(tokenizer, decode_attention="triton", decode_sampler="triton").generate(
        ids, mask, params, torch.Generator().manual_seed(1)
    )
    assert torch.equal(out.responses, ref.responses)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)


def test_engine_philox_sampler_is_seeded_by_the_generator_and_per_row_blocks(tokenizer):
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=12)
    engine = _engine(tokenizer, decode_sampler="triton-philox")
    a = engine.generate(ids, mask, params, torch.Generator().manual_seed(5)).responses
    b = engine.generate(ids, mask, params, torch.Generator().manual_seed(5)).responses
    c = engine.generate(ids, mask, params, torch.Generator().manual_seed(6)).responses
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a block's tokens depend on its own generator only, not on the rows beside it
    blocks = [(1, torch.Generator().manual_seed(7)), (2, torch.Generator().manual_seed(8))]
    whole = engine.generate(ids, mask, params, blocks).responses
    alone = engine.generate(ids[:1], mask[:1], params, [(1, torch.Generator().manual_seed(7))]).responses
    assert torch.equal(whole[:1], alone)


def test_engine_refuses_top_p_with_a_fused_sampler_and_unknown_samplers(tokenizer):
    ids, mask = _prompts()
    engine = _engine(tokenizer, decode_sampler="triton")
    with pytest.raises(ValueError, match="fuses temperature sampling only"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=4, top_p=0.9))
    with pytest.raises(ValueError, match="sampler must be one of"):
        _engine(tokenizer, decode_sampler="cuda-magic")


def test_triton_on_the_cpu_without_the_interpreter_is_refused_by_name(monkeypatch, tokenizer):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = triton_unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason
    with pytest.raises(ValueError, match="cannot run here: .*CUDA"):
        RolloutEngine(build_tiny_llama(tokenizer), 0, [], backend="static", decode_attention="triton")


@pytest.mark.gpu
def test_bf16_flash_decode_and_sampler_on_cuda():
    q, k, v, valid = _attention_inputs(8, 4, 8, 512, 64, seed=4)
    ref = gqa_decode_attention(q, k, v, valid, 0.125, "matmul")
    out = flash_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), valid, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    logits, noise = _logits(64, 32000)
    tok, _ = fused_sample(logits.bfloat16(), 1.0, True, noise)
    ref_tok, _ = sample_tokens(logits.bfloat16().float(), SamplingParams(), noise)
    assert (tok == ref_tok).float().mean() > 0.98


@pytest.mark.gpu
def test_flash_decode_under_torch_compile_matches_eager():
    q, k, v, valid = _attention_inputs(8, 4, 8, 512, 64, seed=5)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    eager = flash_decode(q, k, v, valid, 0.125)
    compiled = torch.compile(lambda *a: flash_decode(*a, 0.125), fullgraph=True)(q, k, v, valid)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv,group,d", [(4, 8, 64), (32, 1, 128)])  # the 1.1B and 7B shapes
def test_kv_end_on_cuda_bf16_compiled_and_recorded(kv, group, d):
    """On the GPU, the kernel with a bound and the kernel without one are two compilations (``HAS_END``),
    which may contract or order their fp32 arithmetic differently: they are held to one bf16 rounding of
    each other. Bit-exact where the kernel is the same: poisoned slots past the bound against clean ones
    (the poison is not read), and a recorded graph replayed at another bound against an eager call with
    that bound (the bound is read at run time)."""
    q, k, v, valid = _attention_inputs(8, kv, group, 512, d, seed=7)
    end = 321
    valid[:, end:] = False
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    bf16 = dict(atol=2e-3, rtol=2**-7)  # one bf16 rounding of outputs of magnitude ~0.1
    unbounded = flash_decode(q, k, v, valid, d**-0.5)
    k_clean, v_clean = k.clone(), v.clone()
    k[:, :, end:], v[:, :, end:] = float("nan"), float("nan")
    kv_end = torch.tensor([end], device=DEVICE)
    eager = flash_decode(q, k, v, valid, d**-0.5, kv_end=kv_end)
    clean = flash_decode(q, k_clean, v_clean, valid, d**-0.5, kv_end=kv_end)
    assert torch.equal(eager, clean), (
        f"the poison past kv_end was read: max diff {(eager - clean).abs().max()}"
    )
    torch.testing.assert_close(eager, unbounded, **bf16, msg=lambda m: f"bound vs unbounded: {m}")
    # under torch.compile the scale arrives as fp64 (s * scale rounds differently unless it is a power of
    # two: 128 ** -0.5 is not). dynamic=False, as the engine compiles its step: the second shape would
    # otherwise recompile this lambda with symbolic sizes, whose launch torch 2.11 feeds a float where
    # Triton wants an int (seen on the H200; the engine never compiles the step dynamically)
    compiled = torch.compile(lambda *a: flash_decode(*a, d**-0.5, kv_end=kv_end), fullgraph=True, dynamic=False)
    out_compiled = compiled(q, k, v, valid)
    assert torch.isfinite(out_compiled).all(), "compiled with kv_end read a poisoned slot"
    torch.testing.assert_close(out_compiled, eager, **bf16, msg=lambda m: f"compiled: {m}")
    # recorded once, replayed at another bound: the bound is read at run time
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    flash_decode(q, k, v, valid, d**-0.5, kv_end=kv_end)
    with torch.cuda.graph(graph):
        out.copy_(flash_decode(q, k, v, valid, d**-0.5, kv_end=kv_end))
    valid[:, 200:] = False
    kv_end.fill_(200)
    graph.replay()
    at_200 = flash_decode(q, k_clean, v_clean, valid, d**-0.5, kv_end=torch.tensor([200], device=DEVICE))
    assert torch.equal(out, at_200), f"replayed at kv_end=200: max diff {(out - at_200).abs().max().item()}"
    torch.testing.assert_close(out, flash_decode(q, k_clean, v_clean, valid, d**-0.5), **bf16)


def test_a_nan_row_gives_a_nan_log_prob_never_a_finite_one():
    logits, noise = _logits(3, 300)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    _, lp = fused_sample(logits, 1.0, True, noise)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1:]).all()


def test_static_only_options_on_the_hf_backend_are_named_not_dropped(tokenizer):
    model = build_tiny_llama(tokenizer)
    with pytest.warns(UserWarning, match=r"decode_sampler='triton' apply to the static engine only"):
        engine = RolloutEngine(model, 0, [], backend="hf", decode_sampler="triton")
    assert engine.backend == "hf"


def test_ppo_config_reaches_the_kernels_and_refuses_unknown_names(tmp_path, tokenizer):
    from rapidfire_hf.config import ConfigError
    from tests.ppo.helpers import tiny_trainer

    def rollout_of(**kernels):
        trainer = tiny_trainer(tmp_path / str(len(kernels)), tokenizer, rollout_backend="static", **kernels)
        batch = trainer.next_prompts(0)
        torch.manual_seed(11)  # the engine draws its noise from the global generator here
        return trainer, trainer.rollout(batch)

    plain_trainer, plain = rollout_of()
    trainer, fused = rollout_of(rollout_decode_attention="triton", rollout_decode_sampler="triton")
    engine = trainer.roller.engine._static
    assert (engine.net.attention, engine.sampler) == ("triton", "triton")
    assert plain_trainer.roller.engine._static.sampler == "torch"
    assert torch.equal(fused.responses, plain.responses)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="rollout_decode_sampler"):
        tiny_trainer(tmp_path / "bad", tokenizer, rollout_decode_sampler="cuda-magic")


def test_a_launch_reaches_the_kernel_and_one_that_is_no_launch_is_refused(monkeypatch):
    """``flash_decode(launch=...)``: its block size sets the splits' lengths and the kernel's ``BLOCK``, its
    warps and stages are the kernel launch's (the default is what ran before: 64 slots, 4 warps, 3 stages);
    the result agrees with the default launch's to fp32 rounding; an invalid launch is refused by name."""
    from rapidfire_hf.kernels import triton_flash_decode as tfd

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 2, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(2, 2, 96, 16, generator=g).to(DEVICE) for _ in "kv")
    valid = torch.ones(2, 96, dtype=torch.bool, device=DEVICE)
    seen = []
    real = tfd._partial_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["BLOCK"], kw["num_warps"], kw["num_stages"]))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(tfd, "_partial_kernel", Spy())
    base = flash_decode(q, k, v, valid, 0.25, splits=1)
    other = flash_decode(q, k, v, valid, 0.25, splits=1, launch=tfd.Launch(32, 2, 2))
    assert seen == [(64, 4, 3), (32, 2, 2)]
    torch.testing.assert_close(other, base, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block_n a power of two"):
        flash_decode(q, k, v, valid, 0.25, launch=tfd.Launch(48, 4, 3))
