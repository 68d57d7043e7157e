"""Decode step over an 8-bit KV cache (``kv_cache_dtype="fp8"`` / ``"int8"``) against the bf16 cache.

    python benchmarks/rollout/kv_cache.py --out $OUT/kv_cache --budget-s 240            # one GPU, Llama-7B shape
    python benchmarks/rollout/kv_cache.py --out /tmp/kv --shape tiny --device cpu      # seconds, tests the script

The question (issue 46): on one 80 GB card the 7B PPO rollout generates in chunks of 32 rows because the
bf16 cache of 32 x 512 tokens is 8 GiB; an 8-bit cache holds twice the rows in the same bytes, but it only
pays if the decode step at the bigger chunk is faster *per token*. So each row times the static engine's
decode step at one (cache dtype, batch): ``ms_per_step`` and ``ms_per_token`` (= step / batch), the cache's
bytes, the call's peak. The model is a random-init bf16 Llama of ``--shape`` built directly on the device;
prompts of ``--prompt-len`` random tokens, ``--new-tokens`` sampled (temperature 1, no stop token, every row
runs every step; context 128 + 384 = 512 by default). ``--decode-mode`` picks the recorded step
("cuda_graph", the default here: no compilation per row) or "compile" (the engine's CUDA default for its first
four shapes; ~20-40 s a row at 7B). Greedy agreement: ``--agree-rows`` prompts decoded greedily with each
cache, the 8-bit tokens against the bf16 cache's (random-init bf16 models have near-tied logits, so a match
rate below 1 is expected; the log-prob gap over the tokens before the first divergence is the cleaner number).

Rows run in priority order (the bf16 baseline, then the 8-bit caches at the baseline's batch, then the bigger
batches; bf16 at the bigger batches last, for reference) and a row not started within ``--budget-s`` is
written as skipped. Writes results.json (environment, arguments, agreement, rows, summary) and results.csv
into --out after every row.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import _prompts, random_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import environment, write_csv, write_json  # noqa: E402
from rapidfire_hf.demo.shapes import LLAMA_SHAPES  # noqa: E402

SHAPES = {
    "llama-7b": LLAMA_SHAPES["llama-7b"],
    "llama-1.1b": LLAMA_SHAPES["llama-1.1b"],
    # CPU-sized, head width 32 like nothing real, only to run the script
    "tiny": dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=512,
    ),
}  # fmt: skip
CACHES = ("bf16", "fp8", "int8")  # "bf16": the model's dtype (kv_cache_dtype=None)


def build_model(shape: str, device: str, dtype: torch.dtype, max_positions: int):
    """A random-init ``LlamaForCausalLM`` of ``shape`` built on ``device`` directly in ``dtype`` (eval)."""
    import transformers

    config = transformers.LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return random_model(config, device, dtype)


def _engine(model, cache: str, mode: str, attention: str):
    from rapidfire_hf.rollout import RolloutEngine

    return RolloutEngine(
        model,
        pad_token_id=0,
        stop_token_ids=[],
        backend="static",
        decode_mode=mode,
        decode_attention=attention,
        kv_cache_dtype=None if cache == "bf16" else cache,
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def agreement(model, caches: list[str], rows: int, prompt_len: int, new_tokens: int, device, mode, attention):
    """Greedy tokens and log-probs of each 8-bit cache against the bf16 cache's, on ``rows`` prompts."""
    from rapidfire_hf.rollout import SamplingParams

    ids, mask = _prompts(rows, prompt_len, model.config.vocab_size, device, mixed=False)
    params = SamplingParams(new_tokens, do_sample=False)
    outs = {c: _engine(model, c, mode, attention).generate(ids, mask, params) for c in ["bf16", *caches]}
    ref = outs["bf16"]
    result = {}
    for cache in caches:
        out = outs[cache]
        same = out.responses == ref.responses
        first = [int((~s).nonzero()[0]) if (~s).any() else new_tokens for s in same]
        # log-prob gap over the tokens both caches chose alike (before each row's first divergence)
        before = (
            torch.arange(new_tokens, device=same.device)[None, :]
            < torch.tensor(first, device=same.device)[:, None]
        )
        gap = (out.logprobs - ref.logprobs).abs()[before]
        result[cache] = {
            "greedy_token_match_rate": round(float(same.float().mean()), 4),
            "greedy_first_divergence": first,
            "logprob_gap_before_divergence_max": round(float(gap.max()), 5) if gap.numel() else None,
            "logprob_gap_before_divergence_mean": round(float(gap.mean()), 6) if gap.numel() else None,
        }
    return {"rows": rows, "new_tokens": new_tokens, "decode_mode": mode, "by_cache": result}


def time_row(
    model, cache: str, batch: int, prompt_len: int, new_tokens: int, device: str, mode: str, attention
):
    """One warm-up and one timed call; ``ms_per_step`` over decode steps 1..T-1 (as benchmarks/rollout)."""
    from rapidfire_hf.rollout import SamplingParams

    ids, mask = _prompts(batch, prompt_len, model.config.vocab_size, device, mixed=False)
    params = SamplingParams(new_tokens, temperature=1.0)
    marks: dict[int, float] = {}

    def hook(k):
        if k in (1, new_tokens - 1):
            _sync(device)
            marks[k] = time.perf_counter()

    engine = None
    try:
        engine = _engine(model, cache, mode, attention)
        t0 = time.perf_counter()
        engine.generate(ids, mask, params, generator=torch.Generator(device).manual_seed(0))
        _sync(device)
        warmup_s = time.perf_counter() - t0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        engine._static.step_callback = hook
        t0 = time.perf_counter()
        engine.generate(ids, mask, params, generator=torch.Generator(device).manual_seed(1))
        _sync(device)
        total = time.perf_counter() - t0
        ran = engine.decode_mode_ran  # a step that failed to record ran eager (warned): the row says so
        buf = engine._static._buf
        cache_bytes = sum(
            t.numel() * t.element_size() for t in [*buf.k, *buf.v, *(buf.k_scale or []), *(buf.v_scale or [])]
        )
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        if engine is not None:
            engine.release()
    ms = (marks[new_tokens - 1] - marks[1]) * 1000 / (new_tokens - 2)
    return {
        "status": "ok",
        "ms_per_step": round(ms, 3),
        "ms_per_token": round(ms / batch, 4),
        "tokens_per_s": round(batch * new_tokens / total, 1),
        "total_s": round(total, 3),
        "warmup_s": round(warmup_s, 2),
        "cache_mib": round(cache_bytes / 2**20, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        "decode_mode_ran": ran,
    }


def plan(caches: list[str], base_batch: int, batches: list[int]) -> list[tuple[str, int]]:
    """(cache, batch) rows in priority order: bf16 at ``base_batch``, each 8-bit cache at every batch (the
    base first), then bf16 at the other batches; bf16 rows only where ``caches`` names it."""
    eight = [c for c in caches if c != "bf16"]
    rows = [("bf16", base_batch)] if "bf16" in caches else []
    rows += [
        (c, b) for b in sorted(set([base_batch, *batches]), key=lambda b: (b != base_batch, b)) for c in eight
    ]
    if "bf16" in caches:
        rows += [("bf16", b) for b in sorted(set(batches) - {base_batch})]
    return rows


def summarize(rows: list[dict], base_batch: int) -> list[dict]:
    """Each ok row's ms per token against bf16 at ``base_batch`` (>1: faster per token)."""
    base = next(
        (r for r in rows if r["cache"] == "bf16" and r["batch"] == base_batch and r["status"] == "ok"), None
    )
    out = []
    for r in rows:
        if r["status"] != "ok":
            continue
        entry = {k: r[k] for k in ("cache", "batch", "ms_per_step", "ms_per_token", "cache_mib")}
        if base is not None:
            entry["per_token_speedup_vs_bf16_base"] = round(base["ms_per_token"] / r["ms_per_token"], 3)
        out.append(entry)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json / results.csv")
    p.add_argument("--shape", default="llama-7b", choices=sorted(SHAPES), help="model shape (random init)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--caches", default="bf16,fp8,int8", help=f"subset of {','.join(CACHES)}")
    p.add_argument("--base-batch", type=int, default=32, help="the bf16 baseline's batch (default 32)")
    p.add_argument("--batches", default="32,64,160", help="batches of the 8-bit caches (default 32,64,160)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=384)
    p.add_argument("--decode-mode", default=None, help="cuda_graph (default on CUDA), compile or eager")
    p.add_argument(
        "--attention", default="auto", help="decode attention: auto (Triton on CUDA), sdpa, matmul"
    )
    p.add_argument(
        "--agree-rows", type=int, default=8, help="prompts of the greedy agreement check (0: skip it)"
    )
    p.add_argument("--agree-tokens", type=int, default=64, help="greedy tokens per prompt of that check")
    p.add_argument("--budget-s", type=float, default=240.0, help="rows not started by then are skipped")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --shape tiny", file=sys.stderr)
        return 2
    caches = [c for c in args.caches.split(",") if c]
    batches = [int(b) for b in args.batches.split(",") if b]
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches or not batches or min(batches + [args.base_batch]) < 1 or args.new_tokens < 3:
        print(f"bad --caches {bad} (of {CACHES}) / --batches / --new-tokens (>= 3)", file=sys.stderr)
        return 2
    if len(set(caches)) != len(caches):
        print(f"--caches names a cache twice: {args.caches}", file=sys.stderr)
        return 2
    if args.agree_rows < 0:
        print(f"--agree-rows must be 0 (skip the check) or more, got {args.agree_rows}", file=sys.stderr)
        return 2
    mode = args.decode_mode or ("cuda_graph" if device == "cuda" else "eager")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"--out {args.out}: cannot create the folder ({exc.strerror})", file=sys.stderr)
        return 2
    meta = {
        "env": environment(torch.device(device) if device == "cuda" else "cpu"),
        "args": vars(args),
        "shape": {"name": args.shape, **SHAPES[args.shape]},
        "dtype": str(dtype).removeprefix("torch."),  # the "bf16" cache rows hold this dtype (fp32 on a CPU)
        "init": "random",
        "decode_mode": mode,
        "timing": "one warm-up call (records the graphs), one timed call; ms_per_step over steps 1..T-1",
    }
    model = build_model(args.shape, device, dtype, max(4096, args.prompt_len + args.new_tokens))
    meta["weight_gib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 3)
    meta["build_s"] = round(time.perf_counter() - start, 1)
    eight = [c for c in caches if c != "bf16"]
    meta["greedy_agreement"] = {"skipped": "--agree-rows 0"}
    try:
        if args.agree_rows > 0:
            meta["greedy_agreement"] = agreement(
                model,
                eight,
                args.agree_rows,
                args.prompt_len,
                args.agree_tokens,
                device,
                mode,
                args.attention,
            )
    except Exception as exc:  # noqa: BLE001 - the timings are still worth having
        meta["greedy_agreement"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(meta["greedy_agreement"]), flush=True)
    rows = []
    for cache, batch in plan(caches, args.base_batch, batches):
        row = {"cache": cache, "batch": batch}
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            row["status"] = f"skipped: time budget ({elapsed:.0f}s > {args.budget_s:.0f}s)"
        else:
            row.update(
                time_row(model, cache, batch, args.prompt_len, args.new_tokens, device, mode, args.attention)
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, {**meta, "complete": False}, rows, args.base_batch)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    summary = _write(out, {**meta, "complete": True}, rows, args.base_batch)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}/results.json, results.csv in {meta['wall_s']} s")
    return 0


def _write(out: Path, meta: dict, rows: list[dict], base_batch: int) -> list[dict]:
    summary = summarize(rows, base_batch)
    write_json(out / "results.json", {**meta, "results": rows, "summary": summary})
    fields = ["cache", "batch", "status", "ms_per_step", "ms_per_token", "tokens_per_s", "cache_mib", "peak_gib",
              "total_s", "warmup_s"]  # fmt: skip
    write_csv(out / "results.csv", rows, fields)
    return summary


if __name__ == "__main__":
    sys.exit(main())
