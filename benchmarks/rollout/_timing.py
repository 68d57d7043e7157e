"""Correctness checks and timed runs for benchmarks/rollout/run.py."""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rapidfire_hf.rollout import RolloutEngine, SamplingParams
from rapidfire_hf.rollout.kv_layout import SLIDING_CACHES
from rapidfire_hf.rollout.moe_decode import MOE_FORMS


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prompts(batch: int, prompt_len: int, vocab: int, device: str, mixed: bool):
    """Random prompts ``[B, P]`` (left-padded to mixed lengths when ``mixed``) and their attention mask."""
    g = torch.Generator().manual_seed(batch * 1000 + prompt_len)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    if mixed:
        for row in range(batch):
            n_pad = (row * prompt_len) // (batch + 1)
            ids[row, :n_pad], mask[row, :n_pad] = 0, 0
    return ids.to(device), mask.to(device)


def random_model(config, device: str, dtype: torch.dtype):
    """A random-init causal LM of ``config`` built on ``device`` directly in ``dtype`` (seed 0, eval mode, no
    stop token: every row runs every step). The one builder of families.py and kv_cache.py."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(before)
    model.generation_config.eos_token_id = None
    return model.eval()


def _first_divergence(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    diff = (a != b).int()
    return [int(d.argmax()) if d.any() else a.shape[1] for d in diff]


def correctness(model, prompt_len: int, new_tokens: int, device: str, path: str = "auto") -> dict:
    """Greedy tokens of the static engine (its ``decode_path``) vs ``model.generate``; sampled log-probs vs a
    fresh forward."""
    ids, mask = _prompts(4, prompt_len, model.config.vocab_size, device, mixed=True)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_path=path)
    ours = engine.generate(ids, mask, SamplingParams(new_tokens, do_sample=False)).responses
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[:, ids.shape[1] :]
    sampled = engine.generate(
        ids, mask, SamplingParams(new_tokens), generator=torch.Generator().manual_seed(0)
    )
    full_mask = torch.cat([mask, torch.ones_like(sampled.responses)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=sampled.sequences, attention_mask=full_mask, position_ids=positions).logits
    logp = logits[:, prompt_len - 1 : -1].float().log_softmax(-1)
    fresh = logp.gather(-1, sampled.responses[..., None]).squeeze(-1)
    diff = (fresh - sampled.logprobs).abs()
    return {
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "decode_path": engine.path,
        "greedy_rows_identical": f"{int((ours == ref).all(-1).sum())}/{ids.shape[0]}",
        "greedy_token_match_rate": round(float((ours == ref).float().mean()), 4),
        "greedy_first_divergence": _first_divergence(ours, ref),
        "greedy_new_tokens": new_tokens,
        "logprob_vs_fresh_forward_max_abs": float(diff.max()),
        "logprob_vs_fresh_forward_mean_abs": float(diff.mean()),
    }


class _StepHook(LogitsProcessor):
    """Calls ``hook(k)`` when HF is about to pick token ``k`` (k = 1 is right after the first decode step)."""

    def __init__(self, prompt_len: int, hook):
        self.prompt_len, self.hook = prompt_len, hook

    def __call__(self, input_ids, scores):
        self.hook(input_ids.shape[1] - self.prompt_len)
        return scores


# "ours_<mode>+<variant>": (decode_attention, decode_sampler, decode_fuse_projections, decode_compile_mode);
# no variant = the defaults
VARIANTS = {  # attention, sampler, fused projections, compile mode, projections' matmul
    "": ("auto", "torch", False, None, "torch"),  # the engine's defaults (auto: Triton attention on a GPU)
    # with --lora-rank: the projections fused, LoRA layers included (decode_fuse_lora); "fuse" leaves them
    "fuse_lora": ("auto", "torch", True, None, "torch"),
    "sdpa": ("sdpa", "torch", False, None, "torch"),  # SDPA attention (the default before 2026-12-04)
    "matmul": ("matmul", "torch", False, None, "torch"),
    "triton": ("triton", "triton-philox", False, None, "torch"),  # the attention and sampling kernels
    "tattn": ("triton", "torch", False, None, "torch"),  # the flash-decoding kernel alone
    "fuse": ("sdpa", "torch", True, None, "torch"),  # one matmul for q/k/v and one for gate/up per layer
    "autotune": ("sdpa", "torch", False, "max-autotune-no-cudagraphs", "torch"),  # inductor's GEMM templates
    "fuse_autotune": ("sdpa", "torch", True, "max-autotune-no-cudagraphs", "torch"),
    "fuse_skinny": ("sdpa", "torch", True, None, "triton"),  # + the Triton skinny matmul for every projection
}


def _runner(model, system: str, ids, mask):
    """``run(n, hook)`` generating ``n`` tokens with ``system``; ``hook(k)`` follows decode step k. An ``ours_``
    system with ``@full`` keeps the full-length masked cache for sliding-window layers instead of their ring
    (``StaticLlama.sliding_cache``), with ``@gather`` / ``@dense`` / ``@grouped`` runs every routed MoE layer in
    that expert form (``StaticLlama.moe_form``; none: the engine's own choice), for the comparisons of
    benchmarks/rollout/families.py; both may be given (``ours_cuda_graph@full@grouped``)."""
    system, *mods = system.split("@")
    sliding = next((m for m in mods if m in SLIDING_CACHES), "")
    moe_form = next((m for m in mods if m in MOE_FORMS), None)
    if len(mods) != bool(sliding) + bool(moe_form) or (mods and not system.startswith("ours_")):
        raise ValueError(
            f"@{'@'.join(mods)}: an ours_ system takes @ring or @full, and/or an MoE form @"
            + ", @".join(MOE_FORMS)
        )
    if system.startswith("ours_"):
        mode, _, variant = system.removeprefix("ours_").partition("+")
        engine = RolloutEngine(
            model,
            pad_token_id=0,
            stop_token_ids=[],
            backend="static",
            decode_mode=mode,
            decode_attention=VARIANTS[variant][0],
            decode_sampler=VARIANTS[variant][1],
            decode_fuse_projections=VARIANTS[variant][2],
            decode_compile_mode=VARIANTS[variant][3],
            decode_linear=VARIANTS[variant][4],
            decode_fuse_lora=variant == "fuse_lora",
        )
        if sliding:
            engine._static.net.sliding_cache = sliding  # before the first cache is allocated
        if moe_form:
            engine._static.net.moe_form = moe_form  # before the first step is recorded; refused by name

        def run(n, hook):
            engine._static.step_callback = hook
            engine.generate(ids, mask, SamplingParams(n, temperature=1.0))

        run.engine = engine  # what the system built (tests/benchmarks/test_rollout_smoke.py reads it)
        return run
    if system.startswith("generic_"):
        # the generic path (the model's own forward over the engine's cache), even where a native one exists
        engine = RolloutEngine(
            model,
            pad_token_id=0,
            stop_token_ids=[],
            backend="static",
            decode_mode=system.removeprefix("generic_"),
            decode_path="generic",
        )

        def run(n, hook):
            engine._static.step_callback = hook
            engine.generate(ids, mask, SamplingParams(n, temperature=1.0))

        run.engine = engine
        return run
    extra = {"cache_implementation": "static"} if system == "hf_static" else {}

    def run(n, hook):
        procs = LogitsProcessorList([_StepHook(ids.shape[1], hook)] if hook else [])
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=procs,
                **extra,
            )

    return run


def time_config(model, system: str, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    """One warm-up and one timed generate call of ``system`` at ``batch``; see run.py's "timing" note."""
    if device != "cuda" and system.startswith(
        ("ours_cuda_graph", "ours_compile", "generic_cuda_graph", "generic_compile")
    ):
        return {"status": "skipped: needs CUDA"}
    ids, mask = _prompts(batch, prompt_len, model.config.vocab_size, device, mixed=False)
    marks: dict[int, float] = {}

    def hook(k):
        if k in (1, new_tokens - 1):
            _sync(device)
            marks[k] = time.perf_counter()

    try:
        run = _runner(model, system, ids, mask)
        t0 = time.perf_counter()
        # the dynamic cache has nothing to specialise on the length, so a short warm-up suffices
        run(min(new_tokens, 16) if system == "hf_dynamic" else new_tokens, None)
        _sync(device)
        warmup_s = time.perf_counter() - t0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        run(new_tokens, hook)
        _sync(device)
        total = time.perf_counter() - t0
        engine = getattr(run, "engine", None)  # the mode that ran: a step that failed to record runs eager
        ran = {"decode_mode_ran": engine.decode_mode_ran} if engine is not None else {}
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as exc:  # noqa: BLE001 - one failing config must not lose the others
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        run = None
    return {
        "status": "ok",
        "ms_per_step": round((marks[new_tokens - 1] - marks[1]) * 1000 / (new_tokens - 2), 3),
        "tokens_per_s": round(batch * new_tokens / total, 1),
        "total_s": round(total, 3),
        "warmup_s": round(warmup_s, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        **ran,
    }
