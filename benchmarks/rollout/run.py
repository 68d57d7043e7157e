"""Rollout benchmark: HF ``generate`` (dynamic and static cache) against the rapidfire static engine.

    python benchmarks/rollout/run.py --out benchmarks/rollout/results            # H200, ~5 minutes
    python benchmarks/rollout/run.py --out /tmp/rollout_smoke --smoke            # tiny model on CPU, seconds

Writes results.json (environment, command, settings, correctness, one row per config), results.csv and
results.png into --out. See README.md next to this file for what is measured.
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

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_shape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import correctness, time_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import write_json  # noqa: E402

# the 1.1B Llama shape of the README's numbers; the smoke shape runs on a CPU in seconds
SHAPES = {"llama-1.1b": LLAMA_SHAPES["llama-1.1b"], "smoke": llama_shape("smoke", vocab_size=128)}
# in priority order (a config not started within --budget-s is skipped); "+matmul" = unfused decode
# attention, "+triton" = the Triton flash-decoding and fused-sampling kernels, "+tattn" = the attention
# kernel alone, "+fuse" = fused q/k/v and gate/up projections, "+autotune" = torch.compile's
# max-autotune-no-cudagraphs, "+fuse_skinny" = fused projections through the Triton skinny matmul,
# "+sdpa" = SDPA attention named (the systems without a "+" run the engine's defaults)
# (_timing.VARIANTS); those systems are opt-in (--systems)
OPT_IN = ("ours_compile+triton", "ours_cuda_graph+triton", "ours_compile+tattn", "ours_cuda_graph+tattn",
          "ours_compile+fuse", "ours_cuda_graph+fuse", "ours_eager+fuse", "ours_compile+autotune",
          "ours_compile+fuse_autotune", "ours_compile+fuse_skinny", "ours_eager+fuse_skinny",
          "ours_compile+sdpa", "ours_cuda_graph+sdpa", "ours_compile+fuse_lora",
          "generic_compile", "generic_cuda_graph", "generic_eager")  # fmt: skip
# "generic_<mode>": the static engine running the model's own forward over its cache (decode_path="generic",
# rollout/generic_forward.py), the path of every decoder-only family without a native forward; on the Llama
# shape it compares directly with the native "ours_<mode>" and with model.generate
SYSTEMS = (
    "ours_cuda_graph",
    "hf_dynamic",
    "ours_eager",
    "ours_cuda_graph+matmul",
    "hf_static",
    "ours_compile",
)


def build_model(shape: str, device: str, dtype: torch.dtype, max_positions: int):
    """Random-init ``LlamaForCausalLM`` built directly on ``device`` (fast for 1.1B on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    # no stop token anywhere: generate would otherwise fall back to this eos and end rows early
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def with_lora(model, rank: int):
    """``model`` under a PEFT LoRA adapter of ``rank`` on q/k/v/o, its B factors drawn (seeded) non-zero."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).mul_(0.01).to(p.device, p.dtype))
    return model.eval()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json / results.csv / results.png")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few seconds (tests the script)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 32,128,256)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens per run (default 384)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS + OPT_IN)}")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="wrap the model in a PEFT LoRA adapter of this rank on q/k/v/o (0: none), as the 7B LoRA PPO "
        "rows; its B factors drawn non-zero so the adapter shows in the output",
    )
    p.add_argument(
        "--no-correctness",
        action="store_true",
        help="skip the correctness section (timing only; results.json says it was skipped)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="configs not started within this many seconds are recorded as skipped",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke, or on a GPU machine", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    shape = "smoke" if args.smoke else "llama-1.1b"
    batches = [int(b) for b in (args.batches or ("2,4" if args.smoke else "32,128,256")).split(",")]
    prompt_len = args.prompt_len or (8 if args.smoke else 128)
    new_tokens = args.new_tokens or (16 if args.smoke else 384)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS + OPT_IN]
    if unknown:
        print(
            f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS + OPT_IN)}", file=sys.stderr
        )
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 correctness must be exact; bf16 is unaffected

    import transformers

    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": {
            "shape": shape,
            **SHAPES[shape],
            "dtype": "bfloat16" if cuda else "float32",
            "init": "random",
        },
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batches": batches,
        "sampling": "do_sample=True, temperature=1.0, top_k=0, top_p=1.0, no stop token (every row runs all steps)",
        "timing": (
            "one warm-up generate call (compiles / records graphs), then one timed call per config. "
            "ms_per_step: wall time between decode steps 1 and T-1 of the timed call (device-synchronised at "
            "both ends) / (T-2), i.e. the average over all contexts from P to P+T. tokens_per_s: B*T / wall "
            "time of the whole timed call, prefill included. peak_gib: torch.cuda.max_memory_allocated in "
            "the timed call (weights included)."
        ),
    }
    max_pos = max(2048, prompt_len + new_tokens)
    model = build_model(shape, device, torch.float32, max_pos)
    if args.lora_rank < 0:
        print(f"--lora-rank {args.lora_rank}: give a rank >= 1, or 0 for no adapter", file=sys.stderr)
        return 2
    if args.lora_rank:
        model = with_lora(model, args.lora_rank)
        meta["lora"] = {"rank": args.lora_rank, "alpha": 2 * args.lora_rank, "targets": list(LORA_TARGETS)}
    skipped = "skipped (--no-correctness)"
    meta["correctness_fp32"] = (
        skipped if args.no_correctness else correctness(model, prompt_len, min(64, new_tokens), device)
    )
    model = model.to(torch.bfloat16) if cuda else model
    if cuda:
        meta["correctness_bf16"] = (
            skipped if args.no_correctness else correctness(model, prompt_len, min(64, new_tokens), device)
        )
    if any(s.startswith("generic_") for s in systems) and not args.no_correctness:
        # the generic path's own check, at the timed dtype (fp32 must match model.generate exactly)
        meta[f"correctness_generic_{'bf16' if cuda else 'fp32'}"] = correctness(
            model, prompt_len, min(64, new_tokens), device, path="generic"
        )
    print(json.dumps({k: v for k, v in meta.items() if k.startswith("correctness")}, indent=1), flush=True)

    rows = []
    for system in systems:
        for batch in batches:
            row = {"system": system, "batch": batch}
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                row["status"] = f"skipped: time budget ({elapsed:.0f}s > {args.budget_s:.0f}s)"
            else:
                row.update(time_config(model, system, batch, prompt_len, new_tokens, device))
            rows.append(row)
            print(json.dumps(row), flush=True)
            # rewritten after every row: a call's time limit that cuts this script keeps what it measured
            write_results(
                out, {**meta, "wall_s": round(time.perf_counter() - start, 1), "complete": False}, rows
            )
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    write_results(out, {**meta, "complete": True}, rows)
    print(f"wrote {out}/results.json, results.csv, results.png in {meta['wall_s']} s")
    return 0


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    write_json(out / "results.json", {**meta, "results": rows})
    fields = ["system", "batch", "ms_per_step", "tokens_per_s", "total_s", "peak_gib", "status"]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(out / "results.png", meta, rows)


def plot(path: Path, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    systems = list(dict.fromkeys(r["system"] for r in ok))
    batches = meta["batches"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        for ax, key in zip(axes, ("ms_per_step", "tokens_per_s")):
            xs = [
                j + i * width
                for j, b in enumerate(batches)
                if any(r["system"] == system and r["batch"] == b for r in ok)
            ]
            ys = [r[key] for b in batches for r in ok if r["system"] == system and r["batch"] == b]
            ax.bar(xs, ys, width, label=system)
    for ax, title in zip(
        axes, ("ms per decode step (lower is better)", "generated tokens / s (higher is better)")
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_title(title)
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"{meta['model']['shape']} on {meta['gpu']}: {meta['prompt_len']} prompt + {meta['new_tokens']} new tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
