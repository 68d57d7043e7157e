"""Decode step per model family at real config shapes: the static engine against ``model.generate``.

    python benchmarks/rollout/families.py --out DIR --budget-s 400       # one H100: < 8 minutes
    python benchmarks/rollout/families.py --out /tmp/fam_smoke --smoke   # tiny models on the CPU, seconds
    # sliding-window layers: the ring of `window` slots against the old full-length masked cache, past the
    # window (Gemma-3-1B: 512), on one H100 in < 3 minutes
    python benchmarks/rollout/families.py --out DIR --families gemma3-1b --prompt-len 128 --new-tokens 1024 \
        --systems ours_cuda_graph --batches 8,64 --sliding-cache ring,full --budget-s 100
    # routed MoE experts: the recorded step with each expert form forced against the engine's own choice
    # (Qwen3-30B-A3B layer shape), on one H100 in < 3 minutes
    python benchmarks/rollout/families.py --out DIR --families qwen3moe-12l --systems ours_cuda_graph \
        --batches 8,64 --moe-form auto,gather,dense,grouped --budget-s 120

Each family's model is built random-init directly on the GPU in bf16 from its published hyper-parameters
(:data:`SHAPES`), all kept resident, and timed in one process: the engine's compiled step (``ours_compile``,
the CUDA default) and its uncompiled recorded step (``ours_cuda_graph``) against ``model.generate`` with the
dynamic cache (``hf_dynamic``) and the static cache (``hf_static``, which transformers compiles), at each
batch. Rows run in priority order (the cheap comparisons for every family first, the compilations after),
and a row not started within ``--budget-s`` is written as skipped, so the call fits its time slot.

``--sliding-cache ring,full`` times every ``ours_`` system twice: as the engine runs it (a local layer's cache a
ring of ``window`` slots) and as ``system@full`` (every layer's cache the whole rollout, the window a mask:
the engine before the ring, ``StaticLlama.sliding_cache``); the summary's ``sliding`` entries give the
full/ring step-time and peak-memory ratios.

``--moe-form auto,gather,dense,grouped`` times every ``ours_`` system of a routed-MoE family once more per
named form, as ``system@form`` (every routed layer in that form, ``StaticLlama.moe_form``; ``auto`` is the
engine's own choice, ``moe_decode.default_form``: dense where ``batch * k > E``, else the grouped GEMM where
it records on CUDA, else gather); the summary's ``moe_form`` entries give each form's step time over the
auto form's (``over_auto``) and the decode mode that ran (a step that fails to record runs eager:
``decode_mode_ran``).

Writes results.json (environment, command, shapes, bf16 greedy agreement per family, rows, per-family
summary with the decode time per weight byte against the Llama row) and results.csv into --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import _prompts, random_model, time_config  # noqa: E402

from rapidfire_hf.rollout.moe_decode import MOE_FORMS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import write_json  # noqa: E402
from rapidfire_hf.demo.shapes import FAMILY_SHAPES, LLAMA_SHAPES  # noqa: E402

# name -> (config class, config kwargs): the Llama 1.1B of the project's numbers as the per-byte reference,
# then the published hyper-parameters of the other families (one home: rapidfire_hf.demo.shapes)
SHAPES = {"llama-1.1b": ("LlamaConfig", LLAMA_SHAPES["llama-1.1b"]), **FAMILY_SHAPES}
# the tiny stand-ins of --smoke: every family's switches, a CPU-sized model
SMOKE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "sliding_window": 8,
    "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip
SYSTEMS = ("ours_cuda_graph", "hf_dynamic", "ours_compile", "hf_static")
BASELINE = "llama-1.1b"


def config_kwargs(name: str, smoke: bool) -> dict:
    """``SHAPES[name]``'s config kwargs, with the smoke sizes over those it has (smoke)."""
    _, kwargs = SHAPES[name]
    if not smoke:
        return dict(kwargs)
    out = {
        **kwargs,
        **{k: v for k, v in SMOKE.items() if k in kwargs or k in ("vocab_size", "num_hidden_layers")},
    }
    if name == "gemma3-1b":
        out["layer_types"] = ["sliding_attention", "full_attention"]
    if name == "pythia-1b":
        out.pop("num_key_value_heads", None), out.pop("head_dim", None)
    return out


def build_model(name: str, device: str, dtype: torch.dtype, smoke: bool, max_positions: int):
    """Random-init model ``name`` built on ``device`` directly in ``dtype`` (eval mode, no stop token)."""
    import transformers

    config = getattr(transformers, SHAPES[name][0])(
        **config_kwargs(name, smoke),
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return random_model(config, device, dtype)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def agreement(model, prompt_len: int, new_tokens: int, device: str, mode: str) -> dict:
    """Greedy tokens of the static engine (``mode``) against ``model.generate`` on 4 mixed-length prompts,
    as a match rate (bf16 random-init models have near-tied logits: tests/rollout/test_families_gpu.py
    holds the exact fp32 check)."""
    from rapidfire_hf.rollout import RolloutEngine, SamplingParams

    ids, mask = _prompts(4, prompt_len, model.config.vocab_size, device, mixed=True)
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode=mode)
    ours = engine.generate(ids, mask, SamplingParams(new_tokens, do_sample=False)).responses
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[:, ids.shape[1] :]  # fmt: skip
    first = [int(d.nonzero()[0]) if d.any() else new_tokens for d in (ours != ref)]
    return {
        "path": engine.path,  # "native" for every family of the table (rollout.engine.choose_decode_path)
        "decode_mode": mode,
        "greedy_token_match_rate": round(float((ours == ref).float().mean()), 4),
        "greedy_first_divergence": first,
        "new_tokens": new_tokens,
    }


def is_moe(name: str) -> bool:
    """Whether family ``name`` has routed experts (the ``@<moe form>`` systems run for it only)."""
    kwargs = SHAPES[name][1]
    return "num_experts" in kwargs or "num_local_experts" in kwargs


def moe_form_of(system: str) -> str | None:
    return next((m for m in system.split("@")[1:] if m in MOE_FORMS), None)


def plan(names: list[str], systems: list[str], batches: list[int]) -> list[tuple[str, str, int]]:
    """Rows in priority order: the uncompiled systems for every family and batch first, then each compiled
    system at the smallest batch for every family, then the larger batches. A forced MoE form
    (``system@gather``...) only for the routed-MoE families."""
    cheap = [s for s in systems if s.partition("@")[0] in ("ours_cuda_graph", "hf_dynamic", "ours_eager")]
    costly = [s for s in systems if s not in cheap]
    rows = [(n, s, b) for n in names for b in batches for s in cheap]
    rows += [(n, s, b) for b in batches for n in names for s in costly]
    return [(n, s, b) for n, s, b in rows if moe_form_of(s) is None or is_moe(n)]


def summarize(rows: list[dict], weights: dict[str, int], batches: list[int]) -> list[dict]:
    """Per family and batch: our compiled step (else recorded step) against generate, and its ms per GiB
    of weights relative to the Llama row's (the issue's per-byte target: within 1.25x)."""
    ok = {(r["family"], r["system"], r["batch"]): r["ms_per_step"] for r in rows if r.get("status") == "ok"}
    out = []
    for fam in weights:
        for b in batches:
            ours_sys = next(
                (s for s in ("ours_compile", "ours_cuda_graph", "ours_eager") if (fam, s, b) in ok), None
            )
            if ours_sys is None:
                continue
            ours = ok[(fam, ours_sys, b)]
            entry = {"family": fam, "batch": b, "ours": ours_sys, "ours_ms": ours,
                     "ms_per_weight_gib": round(ours / (weights[fam] / 2**30), 4)}  # fmt: skip
            for hf in ("hf_dynamic", "hf_static"):
                if (fam, hf, b) in ok:
                    entry[f"{hf}_ms"] = ok[(fam, hf, b)]
                    entry[f"speedup_vs_{hf}"] = round(ok[(fam, hf, b)] / ours, 2)
            out.append(entry)
    for fam, system, b in list(ok):  # the ring against the full-length masked cache (--sliding-cache)
        base_system, _, sliding = system.partition("@")
        if sliding == "full" and (fam, base_system, b) in ok:
            ring, full = ok[(fam, base_system, b)], ok[(fam, system, b)]
            peaks = {r["system"]: r.get("peak_gib") for r in rows
                     if r["family"] == fam and r["batch"] == b and r.get("status") == "ok"}  # fmt: skip
            entry = {"family": fam, "batch": b, "sliding": base_system, "ring_ms": ring, "full_ms": full,
                     "full_over_ring": round(full / ring, 3),
                     "ring_peak_gib": peaks.get(base_system), "full_peak_gib": peaks.get(system)}  # fmt: skip
            out.append(entry)
    for fam, system, b in list(ok):  # each forced MoE form against the engine's own choice (--moe-form)
        form = moe_form_of(system)
        auto_system = system.replace(f"@{form}", "")
        if form is not None and (fam, auto_system, b) in ok:
            ran = {(r["system"]): r.get("decode_mode_ran") for r in rows
                   if r["family"] == fam and r["batch"] == b and r.get("status") == "ok"}  # fmt: skip
            ms, auto = ok[(fam, system, b)], ok[(fam, auto_system, b)]
            out.append({"family": fam, "batch": b, "moe_form": form, "system": auto_system, "ms": ms,
                        "auto_ms": auto, "over_auto": round(ms / auto, 3), "decode_mode_ran": ran.get(system),
                        "auto_decode_mode_ran": ran.get(auto_system)})  # fmt: skip
    moe = [e for e in out if "moe_form" in e]
    out = [e for e in out if "moe_form" not in e]
    out, sliding = [e for e in out if "sliding" not in e], [e for e in out if "sliding" in e]
    base = {e["batch"]: e for e in out if e["family"] == BASELINE}
    for e in out:
        ref = base.get(e["batch"])
        if ref is not None and ref["ours"] == e["ours"]:
            e["per_byte_vs_llama"] = round(e["ms_per_weight_gib"] / ref["ms_per_weight_gib"], 3)
    return out + sliding + moe


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json / results.csv")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU (tests the script)")
    p.add_argument("--families", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 8,64)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens per call (default 128)")
    p.add_argument("--systems", default=None, help=f"subset of {','.join(SYSTEMS)},ours_eager")
    p.add_argument("--budget-s", type=float, default=400.0, help="rows not started by then are skipped")
    p.add_argument(
        "--sliding-cache", default="ring",
        help="ring, or ring,full: also time every ours_ system with the full-length masked cache (system@full)",
    )  # fmt: skip
    p.add_argument(
        "--moe-form", default="auto",
        help=f"auto, or auto then any of {','.join(MOE_FORMS)}: also time every ours_ system of a routed-MoE family "
        "with every routed layer in that expert form (system@form)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke, or on a GPU machine", file=sys.stderr)
        return 2
    names = [n for n in args.families.split(",") if n]
    systems = [
        s
        for s in (args.systems or ("ours_eager,hf_dynamic" if args.smoke else ",".join(SYSTEMS))).split(",")
        if s
    ]
    sliding = [c for c in args.sliding_cache.split(",") if c]
    bad = [n for n in names if n not in SHAPES] + [s for s in systems if s not in (*SYSTEMS, "ours_eager")]
    if not sliding or sliding[0] != "ring" or any(c not in ("ring", "full") for c in sliding):
        print(f"--sliding-cache {args.sliding_cache!r}: 'ring' or 'ring,full'", file=sys.stderr)
        return 2
    forms = [f for f in args.moe_form.split(",") if f]
    if (
        not forms
        or forms[0] != "auto"
        or len(set(forms)) != len(forms)
        or any(f not in MOE_FORMS for f in forms[1:])
    ):
        print(f"--moe-form {args.moe_form!r}: 'auto', then any of {', '.join(MOE_FORMS)}, each once",
              file=sys.stderr)  # fmt: skip
        return 2
    ours = [s for s in systems if s.startswith("ours_")]
    if "full" in sliding:  # each of our systems once more over the full-length masked cache
        systems += [f"{s}@full" for s in ours]
    systems += [f"{s}@{f}" for f in forms[1:] for s in ours]  # and in each forced MoE form
    if bad:
        print(f"unknown family/system {', '.join(bad)}; families: {', '.join(SHAPES)}; "
              f"systems: {', '.join(SYSTEMS)}, ours_eager", file=sys.stderr)  # fmt: skip
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batches = [int(b) for b in (args.batches or ("2" if args.smoke else "8,64")).split(",")]
    prompt_len = args.prompt_len or (8 if args.smoke else 128)
    new_tokens = args.new_tokens or (8 if args.smoke else 128)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    import transformers

    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "dtype": str(dtype).removeprefix("torch."),
        "init": "random",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batches": batches,
        "sliding_cache": sliding,
        "moe_form": forms,
        "sampling": "do_sample=True, temperature=1.0, no stop token (every row runs all steps)",
        "timing": "as benchmarks/rollout/run.py: one warm-up call, one timed call; ms_per_step over steps 1..T-1",
        "shapes": {n: {"config": SHAPES[n][0], **config_kwargs(n, args.smoke)} for n in names},
    }
    models, weights, agree = {}, {}, {}
    max_pos = max(4096, prompt_len + new_tokens)
    for name in names:
        models[name] = build_model(name, device, dtype, args.smoke, max_pos)
        weights[name] = weight_bytes(models[name])
        try:
            agree[name] = agreement(models[name], prompt_len, min(32, new_tokens), device,
                                    "cuda_graph" if cuda else "eager")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a family that fails is a result, not the end of the call
            agree[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(
            json.dumps({"family": name, "weight_gib": round(weights[name] / 2**30, 3), **agree[name]}),
            flush=True,
        )
    meta["weight_gib"] = {n: round(w / 2**30, 3) for n, w in weights.items()}
    meta["greedy_agreement"] = agree

    rows = []
    for name, system, batch in plan(names, systems, batches):
        row = {"family": name, "system": system, "batch": batch}
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            row["status"] = f"skipped: time budget ({elapsed:.0f}s > {args.budget_s:.0f}s)"
        else:
            row.update(time_config(models[name], system, batch, prompt_len, new_tokens, device))
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(out, {**meta, "complete": False}, rows, weights, batches)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    summary = write_results(out, {**meta, "complete": True}, rows, weights, batches)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}/results.json, results.csv in {meta['wall_s']} s")
    return 0


def write_results(out: Path, meta: dict, rows: list[dict], weights: dict, batches: list[int]) -> list[dict]:
    summary = summarize(rows, weights, batches)
    write_json(out / "results.json", {**meta, "results": rows, "summary": summary})
    fields = [
        "family",
        "system",
        "batch",
        "ms_per_step",
        "tokens_per_s",
        "total_s",
        "warmup_s",
        "peak_gib",
        "status",
    ]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return summary


if __name__ == "__main__":
    sys.exit(main())
