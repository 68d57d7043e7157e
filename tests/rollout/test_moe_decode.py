"""The routed MoE decode (rollout/moe_decode.py) against the models' own MoE blocks (CPU, fp32), and proof
that it has no host sync or data-dependent shape, so a CUDA graph can record it; each of its expert forms
forced through the engine gives ``model.generate``'s greedy tokens."""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy
from family_cases import GREEDY_TOKENS, build, case
from torch.fx.experimental.proxy_tensor import make_fx

from rapidfire_hf.rollout import RolloutEngine, SamplingParams, moe_decode
from rapidfire_hf.rollout.families import FAMILIES
from rapidfire_hf.rollout.llama_forward import StaticLlama
from rapidfire_hf.rollout.moe_decode import (
    MOE_FORMS,
    default_form,
    grouped_form_reason,
    moe_layout_reason,
    routed_moe,
)

# (case, config overrides): the tiny cases and a Qwen3-30B-A3B-like routing (8 of 128 experts)
SHAPES = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": True}),
    (
        "qwen3_moe",
        {"num_experts": 128, "num_experts_per_tok": 8, "mlp_only_layers": [], "num_hidden_layers": 1},
    ),
    ("mixtral", {}),
    ("mixtral", {"num_local_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 1}),
    ("olmoe", {}),
    ("olmoe", {"norm_topk_prob": True}),
    ("flex_olmo", {}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("granitemoe", {}),
    ("granitemoe", {"num_local_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 1}),
    ("granitemoeshared", {}),
]
# every routed family of tests/rollout/family_cases.py
MOE_CASES = ["qwen3_moe", "mixtral", "olmoe", "flex_olmo", "qwen2_moe", "granitemoe", "granitemoeshared"]


def _moe_blocks(name, overrides):
    model = build(case(name), 64, **overrides)
    mlps = [getattr(layer, FAMILIES[model.config.model_type].mlp) for layer in model.model.layers]
    return model, [m for m in mlps if hasattr(m, "experts")]


@pytest.mark.parametrize("form", [*MOE_FORMS, None])
@pytest.mark.parametrize("name,overrides", SHAPES)
def test_routed_moe_equals_the_models_block(name, overrides, form):
    model, blocks = _moe_blocks(name, overrides)
    assert blocks
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    torch.manual_seed(0)
    for mlp in blocks:
        assert moe_layout_reason(mlp, model.config) is None
        for batch in (1, 8, 64):
            h = torch.randn(batch, model.config.hidden_size)
            with torch.no_grad():
                ref = mlp(h[:, None, :])
                ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1)
                out = routed_moe(mlp, h, model.config.model_type, norm, form)
            assert (out - ref).abs().max() <= 1e-6 * max(1.0, ref.abs().max().item())


def _trace_decode_step(net, b, dtype=torch.float32):
    """The decode step of ``net`` at batch ``b`` traced with fake tensors: its graph."""
    length = 16
    k, v = net.new_cache(b, length, "cpu")
    pos = torch.arange(length).expand(b, length)
    cos, sin = net.rope_table(pos)
    valid = torch.ones(b, length, dtype=torch.bool)

    def step(tokens, slot, cos, sin, valid, *cache):
        return net.decode(tokens, slot, cos, sin, valid, list(cache[: len(k)]), list(cache[len(k) :]))

    args = (
        torch.arange(3, 3 + b),
        torch.tensor([5]),
        cos[:, :, 5].to(dtype),
        sin[:, :, 5].to(dtype),
        valid,
        *k,
        *v,
    )
    with torch.no_grad():
        return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


# (form, dtype): torch's meta kernel of torch._grouped_mm takes bf16 only, so the grouped form traces in bf16
TRACED = [
    (None, torch.float32),
    ("gather", torch.float32),
    ("dense", torch.float32),
    ("grouped", torch.bfloat16),
]


@pytest.mark.parametrize("form,dtype", TRACED)
@pytest.mark.parametrize("name", MOE_CASES)
def test_decode_step_runs_routed_moe_and_has_no_host_sync(name, form, dtype):
    """The decode step traced with fake tensors: a host read (``.item``, ``nonzero``, a data-dependent
    shape) cannot be traced at all, and none of the ops that make one appear in the graph. A forced form
    is the one that runs: the grouped form's graph has torch's grouped GEMM, the others have none."""
    model = build(case(name), 64).to(dtype)
    net = StaticLlama(model, attention="matmul", moe_form=form)
    moe_layers = [i for i, m in enumerate(net.mlps) if hasattr(m, "experts")]
    assert moe_layers and all(net.moe_native[i] for i in moe_layers) and net.moe_reason is None
    b = 4
    graph = _trace_decode_step(net, b, dtype)
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert not {o for o in ops if "_local_scalar_dense" in o or "nonzero" in o}, ops
    assert any("topk" in o for o in ops)  # the routing is in the traced step
    assert any("_grouped_mm" in o for o in ops) == (form == "grouped"), ops
    # the checker sees a host read where there is one: the model's block with transformers' eager expert
    # loop (a Python loop over the experts that ``nonzero`` found: each iteration reads a value on the host)
    mlp = net.mlps[moe_layers[0]]
    model.config._experts_implementation = "eager"
    with torch.no_grad(), pytest.raises(RuntimeError, match="_local_scalar_dense"):
        make_fx(lambda h: mlp(h[:, None, :]))(torch.randn(b, model.config.hidden_size, dtype=dtype))


def test_unknown_form_is_refused_by_name():
    _, blocks = _moe_blocks("mixtral", {})
    with pytest.raises(ValueError, match="form must be"):
        routed_moe(blocks[0], torch.zeros(2, 64), "mixtral", form="sparse")


def test_unknown_expert_layout_keeps_the_module_call_and_says_so():
    model = build(case("mixtral"), 64)
    for layer in model.model.layers:  # a layout this decode does not know: transposed experts
        layer.mlp.experts.is_transposed = True
    with pytest.warns(UserWarning, match="transposed"):
        net = StaticLlama(model, attention="matmul")
    assert not any(net.moe_native) and "transposed" in net.moe_reason


@pytest.mark.parametrize("form", MOE_FORMS)
@pytest.mark.parametrize("name", MOE_CASES)
def test_routed_moe_is_bit_exact_in_bf16(name, form):
    """bf16: the routing weights' dtype flow (Qwen3-MoE casts them to bf16, Mixtral keeps fp32 until the
    sum) decides the rounding; the dense and grouped forms equal the block's default experts implementation
    (torch's grouped GEMM) bit for bit. The gather form multiplies by a batched matrix-vector product, whose
    accumulation order is not the GEMM's, and the rounding of its output then passes through the weighting
    and the sum over k: within two bf16 steps of the block's output, on a few elements at most (the
    granitemoeshared case: 1 element of 4,096, 0.12256 against 0.12158, two steps of 2**-11; CPU, torch 2.13)."""
    model, blocks = _moe_blocks(name, {})
    model.to(torch.bfloat16)
    torch.manual_seed(1)
    h = torch.randn(64, model.config.hidden_size, dtype=torch.bfloat16)
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    with torch.no_grad():
        for mlp in blocks:
            ref = mlp(h[:, None, :])
            ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1)
            out = routed_moe(mlp, h, model.config.model_type, norm, form)
            if form != "gather":
                assert torch.equal(out, ref)
                continue
            off = out != ref
            steps = (
                2
                * torch.finfo(torch.bfloat16).eps
                * ref.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
            )  # eps * |x| is at least one bf16 step at x
            assert off.sum() <= 4 and bool(((out.float() - ref.float()).abs() <= steps)[off].all())


@pytest.mark.parametrize("form", MOE_FORMS)
@pytest.mark.parametrize("name", MOE_CASES)
def test_a_forced_form_gives_generates_greedy_tokens(tokenizer, prompts, name, form, monkeypatch):
    """Each form forced on the engine's net (as benchmarks/rollout/families.py ``--moe-form`` does) runs at
    every routed layer and step, and the greedy tokens are ``model.generate``'s (CPU, fp32)."""
    import rapidfire_hf.rollout.llama_forward as llama_forward

    model = build(case(name), len(tokenizer))
    ids, mask = prompts
    ref = hf_greedy(model, ids, mask, GREEDY_TOKENS, stop=None)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path="native")
    engine._static.net.moe_form = form
    ran = []

    def spy(mlp, h, model_type, norm_topk_prob=True, form=None, grouped_ok=False):
        ran.append(form)
        return routed_moe(mlp, h, model_type, norm_topk_prob, form, grouped_ok)

    monkeypatch.setattr(llama_forward, "routed_moe", spy)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=GREEDY_TOKENS, do_sample=False))
    assert ran and set(ran) == {form}
    assert torch.equal(out.responses, ref)
    assert len(set(ref.flatten().tolist())) >= 8


def test_forcing_the_grouped_form_where_torch_cannot_run_it_is_refused_by_name(monkeypatch):
    model, blocks = _moe_blocks("mixtral", {})
    h = torch.randn(4, model.config.hidden_size)
    # traced in fp32: torch's meta kernel refuses the dtype; the error names the form
    with torch.no_grad(), pytest.raises(RuntimeError, match="form='grouped': torch._grouped_mm refused"):
        make_fx(
            lambda x: routed_moe(blocks[0], x, "mixtral", form="grouped"),
            tracing_mode="fake",
            _allow_non_fake_inputs=True,
        )(h)
    # CUDA: one kernel for bf16 on compute capability 9.x / 10.x only (else torch loops on the host)
    assert "bfloat16 only" in grouped_form_reason("cuda", torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "not 8.0" in grouped_form_reason("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert grouped_form_reason("cuda", torch.bfloat16) is None
    assert grouped_form_reason("cpu", torch.float32) is None
    # a torch without the op: forcing the form says so, never runs another form
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ValueError, match="form='grouped' cannot run here: .* no torch._grouped_mm"):
        routed_moe(blocks[0], h, "mixtral", form="grouped")
    with pytest.raises(
        ValueError, match="moe_form='grouped' cannot run on this model: .* no torch._grouped_mm"
    ):
        StaticLlama(model, attention="matmul", moe_form="grouped")
    net = StaticLlama(model, attention="matmul")  # the default needs no grouped GEMM
    assert net.moe_form is None
    with pytest.raises(ValueError, match="moe_form='grouped' cannot run"):
        net.moe_form = "grouped"
    assert net.moe_form is None


def test_a_bad_moe_form_is_refused_by_name():
    model = build(case("mixtral"), 64)
    with pytest.raises(ValueError, match="moe_form must be None or one of"):
        StaticLlama(model, attention="matmul", moe_form="sparse")
    with pytest.raises(ValueError, match="no routed MoE layer"):
        StaticLlama(build(case("llama"), 64), attention="matmul", moe_form="gather")


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE_CASES)
def test_the_grouped_form_records_on_cuda_in_bf16(tokenizer, prompts, name):
    """Where the GPU runs torch's grouped GEMM as one kernel (bf16, compute capability 9.x / 10.x): the
    grouped form's output is the model block's within bf16 rounding (1e-2 of the largest value: other
    kernels, other summation order), and the decode step with it forced records as a CUDA graph (no fall back
    to eager) and replays the same greedy tokens."""
    import warnings

    reason = grouped_form_reason("cuda", torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    model = build(case(name), len(tokenizer)).cuda().to(torch.bfloat16)
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    torch.manual_seed(2)
    h = torch.randn(64, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        mlps = [getattr(layer, FAMILIES[model.config.model_type].mlp) for layer in model.model.layers]
        for mlp in [m for m in mlps if hasattr(m, "experts")]:
            ref = mlp(h[:, None, :])
            ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1).float()
            out = routed_moe(mlp, h, model.config.model_type, norm, "grouped").float()
            assert (out - ref).abs().max() <= 1e-2 * max(1.0, ref.abs().max().item())
    ids, mask = (x.cuda() for x in prompts)
    engine = RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="cuda_graph"
    )
    engine._static.net.moe_form = "grouped"
    params = SamplingParams(max_new_tokens=32, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = (engine.generate(ids, mask, params).responses for _ in range(2))
    assert not [str(w.message) for w in caught if "decode_mode=" in str(w.message)]
    assert engine._static.decode_mode == "cuda_graph" and torch.equal(first, second)


def test_the_default_form_follows_batch_and_device():
    """dense once the (row, expert) pairs outnumber the experts; below that the grouped GEMM where it records
    on CUDA (the H100 call in default_form's docstring), gather elsewhere."""
    assert default_form(8, 8, 128, grouped_ok=True) == "grouped"
    assert default_form(8, 8, 128, grouped_ok=False) == "gather"
    assert default_form(16, 8, 128, grouped_ok=True) == "grouped"  # 128 pairs: not more than the experts
    assert default_form(17, 8, 128, grouped_ok=True) == "dense"
    assert default_form(64, 8, 128, grouped_ok=False) == "dense"


def test_routed_moe_runs_the_grouped_gemm_by_default_where_the_caller_says_it_records(monkeypatch):
    """form None with grouped_ok: the grouped path runs (spied) and gives the block's output (fp32); on a
    CPU model StaticLlama never says grouped_ok, so its default stays gather / dense there."""
    model, blocks = _moe_blocks(
        "qwen3_moe",
        {"num_experts": 128, "num_experts_per_tok": 8, "mlp_only_layers": [], "num_hidden_layers": 1},
    )
    ran = []
    real = moe_decode._grouped_experts
    monkeypatch.setattr(moe_decode, "_grouped_experts", lambda *a: ran.append(1) or real(*a))
    torch.manual_seed(0)
    h = torch.randn(4, model.config.hidden_size)
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    with torch.no_grad():
        ref = blocks[0](h[:, None, :])
        ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1)
        out = routed_moe(blocks[0], h, model.config.model_type, norm, None, grouped_ok=True)
        assert ran and (out - ref).abs().max() <= 1e-6 * max(1.0, ref.abs().max().item())
        ran.clear()
        routed_moe(blocks[0], h, model.config.model_type, norm, None, grouped_ok=False)
        assert not ran
    assert StaticLlama(model, attention="matmul")._grouped_ok is False


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE_CASES)
def test_the_default_form_is_grouped_on_cuda_and_compiles(tokenizer, prompts, name):
    """The engine's default decode (compiled, then recorded) on a bf16 MoE model on a GPU where the grouped
    GEMM records: a small batch runs the grouped form and compiles without falling back; a second call replays
    the same greedy tokens. (The grouped form's arithmetic against the block: the test above, and the CPU
    tests in fp32 / bf16.)"""
    import warnings

    reason = grouped_form_reason("cuda", torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    model = build(case(name), len(tokenizer)).cuda().to(torch.bfloat16)
    # 2 rows: 2 * k (row, expert) pairs do not outnumber the experts (Mixtral's 4), so the default is grouped
    ids, mask = (x[:2].cuda() for x in prompts)
    params = SamplingParams(max_new_tokens=32, do_sample=False)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="compile")
    assert engine._static.net._grouped_ok
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    # the form the step takes, asked outside it. With a spy inside the compiled step (a closure appending to a
    # list) this test failed the capture on an H100 twice, while the same engine without the spy compiled and
    # recorded in its own process (benchmarks/rollout/results/h100/call_2026-12-07d/moe_diag.jsonl); a guard
    # on the list recompiling during the capture is the likely cause
    assert default_form(ids.shape[0], cfg.num_experts_per_tok, experts, True) == "grouped"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = (engine.generate(ids, mask, params).responses for _ in range(2))
    assert not [str(w.message) for w in caught if "decode_mode=" in str(w.message)]
    assert engine.decode_mode_ran == "compile" and not engine.decode_fallbacks
    assert torch.equal(first, second)


def test_the_start_table_says_how_the_experts_run():
    """The start table's rollout line names the routed experts' forms for the run's device: the batch from
    which dense runs, and below it gather on the CPU; nothing for a model without routed layers."""
    from rapidfire_hf.rollout.moe_decode import default_form_said

    model = build(case("qwen3_moe"), 64, num_experts=16, num_experts_per_tok=4, mlp_only_layers=[])
    said = default_form_said(model, torch.device("cpu"))
    assert said == "routed MoE experts (4 of 16): dense from batch 5, below it gather"
    assert default_form(5, 4, 16, grouped_ok=True) == "dense" and default_form(4, 4, 16, True) == "grouped"
    if not torch.cuda.is_available():  # a GPU this process cannot see: the rule, not a verdict
        assert "the grouped GEMM where it records" in default_form_said(model, torch.device("cuda"))
    assert default_form_said(build(case("llama"), 64), torch.device("cpu")) is None


def test_a_shared_expert_is_added_or_the_block_is_refused_by_name():
    """Qwen2-MoE's sigmoid-gated shared expert is part of its block's output (dropping it changes the
    result); a block of another family carrying one, or a Qwen2-MoE block without it, keeps the module
    call with the reason said, never a routed decode that leaves it out."""
    model, blocks = _moe_blocks("qwen2_moe", {})
    h = torch.randn(8, model.config.hidden_size)
    with torch.no_grad():
        full = routed_moe(blocks[0], h, "qwen2_moe", False)
        shared = torch.sigmoid(blocks[0].shared_expert_gate(h)) * blocks[0].shared_expert(h)
    assert shared.abs().max() > 1e-3  # the shared expert counts at this size
    assert (full - shared).abs().max() > 1e-3  # and so do the routed experts
    del blocks[0].shared_expert_gate
    assert "lacks the shared expert" in moe_layout_reason(blocks[0], model.config)
    other, other_blocks = _moe_blocks("olmoe", {})
    other_blocks[0].shared_expert = torch.nn.Identity()
    reason = moe_layout_reason(other_blocks[0], other.config)
    assert "shared_expert" in reason and "'olmoe'" in reason
