"""Step time and peak memory of RapidFireOptimizer against torch's fused AdamW.

Full fine-tuning of a random-init 1.1B Llama shape (hidden 2048, 22 layers, 32 heads, 4 KV heads,
vocab 32000) with **bf16 parameters and bf16 AdamW state** (no fp32 master copy: what the optimizer
saves is then easiest to read, one gradient = 2 bytes/param), sequence 512, on one CUDA GPU:

* ``torch_adamw``: ``torch.optim.AdamW(fused=True)``, ``backward(); step(); zero_grad()``
* ``rf_pipeline_off``: RapidFireOptimizer with everything off (the wrapper's own cost)
* ``rf_pipeline_on``: the gradient pipeline (update during backward, gradients freed), default
  buckets (``pipeline_bucket_mb=64``: one inner step per ~64 MiB of gradient)
* ``rf_pipeline_bucket<N>``: the same with ``pipeline_bucket_mb=N`` (``--bucket-mb``, default 0 32 128;
  0 = one inner step per parameter, the pre-bucket behaviour)
* ``rf_pipeline_rollback``: pipeline + verification every step + device snapshot for rollback
* ``rf_pipeline_rollback_host``: the same with the snapshot in pinned host memory
* ``rf_verify_only``: pipeline off + verification (verify-then-apply needs no snapshot)
* ``*_accum``: 8 micro-batches per optimizer step instead of 1 (2 with ``--smoke``)
* ``bnb_adamw8bit`` / ``rf_adamw8bit_pipeline``: bitsandbytes 8-bit inner (when installed)
* ``rf_pipeline_overlap`` / ``rf_rollback_overlap``: ``pipeline_overlap=1``, the bucket steps (and the
  device snapshot) on a side CUDA stream next to backward (and the next forward)
* ``*_ckpt``: the model with activation checkpointing (``gradient_checkpointing_enable()``), the
  regime where a full gradient buffer, not the activations, sets the peak: what the pipeline frees
  shows up in ``peak_gib`` there; without checkpointing the peak is at the start of backward, when
  no gradient exists yet in either loop

``held_at_step_gib`` is the memory allocated just before ``step()``: parameters + optimizer state +
the gradients still held (all of them for a plain loop, none for a pipelined window).

plus the time of one snapshot (device, host) and one rollback (restore). Each variant reports the
median/min/max step time and, on CUDA, the peak allocated memory over the timed steps
(``torch.cuda.max_memory_allocated``, ``peak_gib``). Writes ``results.json`` and ``results.png`` to
``--out``. ``--smoke`` runs a tiny model on the CPU in seconds; ``--preset cpu_small`` a small Llama
(hidden 256, 8 layers, fp32) on the CPU, for step-time comparisons without a GPU.

    python benchmarks/optimizer/run.py --out benchmarks/optimizer/results
    python benchmarks/optimizer/run.py --out DIR --rounds 1 --interleave 24 --only torch_adamw \
        rf_pipeline_on rf_verify_only rf_pipeline_rollback   # per-step paired ratios (step times)
    python benchmarks/optimizer/run.py --out /tmp/rf_smoke --smoke
    python benchmarks/optimizer/run.py --out /tmp/rf_cpu --preset cpu_small \
        --only torch_adamw rf_pipeline_off rf_pipeline_on rf_pipeline_bucket0 --no-snapshot
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rapidfire_hf.optim import RapidFireOptimizer, Snapshot
from rapidfire_hf.utils.imports import is_available

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import write_json  # noqa: E402

FULL = {
    "hidden": 2048,
    "layers": 22,
    "heads": 32,
    "kv_heads": 4,
    "vocab": 32000,
    "intermediate": 5632,
    "seq": 512,
    "batch": 4,
    "dtype": torch.bfloat16,
    "warmup": 2,
    "steps": 8,
    "accum": 8,
}
SMOKE = {
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 128,
    "intermediate": 128,
    "seq": 32,
    "batch": 2,
    "dtype": torch.float32,
    "warmup": 1,
    "steps": 2,
    "accum": 2,
}
CPU_SMALL = {
    "hidden": 256,
    "layers": 8,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 2048,
    "intermediate": 688,
    "seq": 64,
    "batch": 2,
    "dtype": torch.float32,
    "warmup": 3,
    "steps": 15,
    "accum": 2,
}
PRESETS = {"full": FULL, "smoke": SMOKE, "cpu_small": CPU_SMALL}
DEFAULT_BUCKETS = (0.0, 32.0, 128.0)


BINDING_CLIP = 1e-3  # max_grad_norm of the clipping variants: below any gradient norm of the workload


class ClippedAdamW(torch.optim.AdamW):
    """The reference for the clipping variants: ``clip_grad_norm_`` then AdamW, as a trainer does."""

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, BINDING_CLIP)
        return super().step(closure)


def variants(device: str, accum: int, buckets=DEFAULT_BUCKETS) -> dict[str, tuple]:
    """name -> (optimizer factory(params), micro-batches per step, observe_loss?)."""
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    out = {
        "torch_adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-5, **fused), 1, False),
        "rf_pipeline_off": (lambda ps: RapidFireOptimizer(ps, lr=1e-5), 1, False),
        "rf_pipeline_on": (lambda ps: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True), 1, False),
    }
    for mb in buckets:
        out[f"rf_pipeline_bucket{mb:g}"] = (
            lambda ps, mb=mb: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True, pipeline_bucket_mb=mb),
            1,
            False,
        )
    out |= {
        "rf_pipeline_rollback": (
            lambda ps: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True, rollback="auto"),
            1,
            True,
        ),
        "rf_pipeline_rollback_host": (
            lambda ps: RapidFireOptimizer(
                ps, lr=1e-5, gradient_pipeline=True, rollback="auto", snapshot="host"
            ),
            1,
            True,
        ),
        "rf_verify_only": (lambda ps: RapidFireOptimizer(ps, lr=1e-5, rollback="auto"), 1, True),
        # clipping that binds at every step (max_grad_norm far below the norm): the exact mode defers
        # every window to step(); the scale mode pipelines them with a predicted coefficient
        "torch_adamw_clip": (lambda ps: ClippedAdamW(ps, lr=1e-5, **fused), 1, False),
        "rf_clip_exact": (
            lambda ps: RapidFireOptimizer(
                ps, lr=1e-5, gradient_pipeline=True, rollback="auto", max_grad_norm=BINDING_CLIP
            ),
            1,
            True,
        ),
        "rf_clip_scale": (
            lambda ps: RapidFireOptimizer(
                ps,
                lr=1e-5,
                gradient_pipeline=True,
                rollback="auto",
                max_grad_norm=BINDING_CLIP,
                clip_prediction="scale",
                clip_tolerance=0.5,
            ),
            1,
            True,
        ),
        "rf_pipeline_overlap": (
            lambda ps: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True, pipeline_overlap=1.0),
            1,
            False,
        ),
        "rf_rollback_overlap": (
            lambda ps: RapidFireOptimizer(
                ps, lr=1e-5, gradient_pipeline=True, rollback="auto", pipeline_overlap=1.0
            ),
            1,
            True,
        ),
        # activation checkpointing: the peak is the optimizer step's (gradients + state), not backward's
        "torch_adamw_ckpt": (lambda ps: torch.optim.AdamW(ps, lr=1e-5, **fused), 1, False, True),
        "rf_pipeline_ckpt": (
            lambda ps: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True),
            1,
            False,
            True,
        ),
        "rf_rollback_ckpt": (
            lambda ps: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True, rollback="auto"),
            1,
            True,
            True,
        ),
        "torch_adamw_accum": (lambda ps: torch.optim.AdamW(ps, lr=1e-5, **fused), accum, False),
        "rf_pipeline_on_accum": (
            lambda ps: RapidFireOptimizer(ps, lr=1e-5, gradient_pipeline=True, accumulation_steps=accum),
            accum,
            False,
        ),
        # the verification and rollback machinery on a longer optimizer step (8 micro-batches): the
        # snapshot and the verdict are per step, so their share shrinks as the step grows
        "rf_verify_accum": (
            lambda ps: RapidFireOptimizer(ps, lr=1e-5, rollback="auto", accumulation_steps=accum),
            accum,
            True,
        ),
        "rf_rollback_accum": (
            lambda ps: RapidFireOptimizer(
                ps, lr=1e-5, gradient_pipeline=True, rollback="auto", accumulation_steps=accum
            ),
            accum,
            True,
        ),
    }
    if device == "cuda" and is_available("bitsandbytes"):
        import bitsandbytes as bnb

        out["bnb_adamw8bit"] = (lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-5), 1, False)
        out["rf_adamw8bit_pipeline"] = (
            lambda ps: RapidFireOptimizer(ps, optimizer="adamw8bit", lr=1e-5, gradient_pipeline=True),
            1,
            False,
        )
    return out


def build_model(shape: dict, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidfire_hf.demo.shapes import config_kwargs

    config = LlamaConfig(
        **config_kwargs(shape),
        max_position_embeddings=max(shape["seq"], 64),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):  # build on the GPU: random init of 1.1B on the CPU is slow
        return LlamaForCausalLM(config).to(shape["dtype"])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class VariantLoop:
    """One variant's model, optimizer and batch; ``step()`` runs one timed optimizer step (all its
    micro-batches, ``step()``, ``zero_grad()``) between two device synchronisations."""

    def __init__(self, shape: dict, device: str, make_opt, micro: int, observe: bool, ckpt: bool = False):
        self.shape, self.device, self.micro, self.observe = shape, device, micro, observe
        self.model = build_model(shape, device)
        if ckpt:
            self.model.gradient_checkpointing_enable()
            self.model.train()
        self.opt = make_opt(self.model.parameters())
        self.ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)

    def step(self) -> tuple[float, float, float | None]:
        """-> (seconds of the whole step, seconds of optimizer work, GiB allocated just before step())."""
        hooks_before = hook_seconds(self.opt)
        sync(self.device)
        start = time.perf_counter()
        for _ in range(self.micro):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
            if self.observe:
                self.opt.observe_loss(loss)
            (loss / self.micro).backward()
        step_start = time.perf_counter()
        # an allocator counter: no sync
        held = torch.cuda.memory_allocated() / 2**30 if self.device == "cuda" else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        end = time.perf_counter()
        # optimizer work: the step() call plus the time the pipeline's hooks spent stepping buckets
        # (host time; on CUDA the kernels launched in the hooks may still run after they return)
        return end - start, end - step_start + hook_seconds(self.opt) - hooks_before, held

    def close(self) -> dict | None:
        stats = self.opt.stats() if isinstance(self.opt, RapidFireOptimizer) else None
        del self.model, self.opt, self.ids
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return stats


def run_variant(shape: dict, device: str, make_opt, micro: int, observe: bool, ckpt: bool = False) -> dict:
    loop = VariantLoop(shape, device, make_opt, micro, observe, ckpt)
    times, opt_times, held = [], [], []
    for i in range(shape["warmup"] + shape["steps"]):
        if i == shape["warmup"] and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t, o, h = loop.step()
        times.append(t)
        opt_times.append(o)
        if h is not None:
            held.append(h)
    result = {
        "times_ms": [1e3 * t for t in times[shape["warmup"] :]],
        "opt_ms": [1e3 * t for t in opt_times[shape["warmup"] :]],
        "micro_batches": micro,
        "held_at_step_gib": statistics.median(held[shape["warmup"] :]) if held else None,
    }
    # peak allocated over the timed steps (reset after warm-up); not measured on the CPU
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    stats = loop.close()
    if stats is not None:
        result["stats"] = stats
    return result


def run_interleaved(shape: dict, device: str, chosen: dict, steps: int) -> dict:
    """Step-level interleaving: every chosen variant's model and optimizer stay resident (built from the
    same seed), and each of ``steps`` rounds runs ONE step of every variant, in an order that rotates
    by one each round. A variant and its reference then run seconds apart under the same clocks, host
    load and GPU temperature, so the per-step paired ratio removes the drift that made the round-level
    runs of 2026-11-30 spread from 60 to 89 ms for one variant. Step times only: memory peaks of
    variants that share the GPU cannot be told apart (``peak_gib`` and ``held_at_step_gib`` come from
    the sequential rounds)."""
    loops = {name: VariantLoop(shape, device, *spec) for name, spec in chosen.items()}
    names = list(loops)
    for _ in range(shape["warmup"]):
        for name in names:
            loops[name].step()
    times: dict[str, list[float]] = {n: [] for n in names}
    opt_times: dict[str, list[float]] = {n: [] for n in names}
    for i in tqdm(range(steps), desc="interleaved steps", disable=None):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t, o, _ = loops[name].step()
            times[name].append(1e3 * t)
            opt_times[name].append(1e3 * o)
    out = {}
    for name in names:
        out[name] = {
            "step_ms_p50": statistics.median(times[name]),
            "step_ms_min": min(times[name]),
            "step_ms_max": max(times[name]),
            "opt_ms_p50": statistics.median(opt_times[name]),
            "times_ms": times[name],
            "micro_batches": chosen[name][1],
        }
    for name in names:
        ref = out.get(reference_of(name))
        if ref is None or ref is out[name]:
            continue
        ratios = sorted(a / b for a, b in zip(out[name]["times_ms"], ref["times_ms"]))
        out[name]["vs_reference"] = {
            "reference": reference_of(name),
            "pairs": len(ratios),
            "median": statistics.median(ratios),
            # the middle half of the per-step ratios, and a 95% interval of the median (order statistics)
            "q25": ratios[len(ratios) // 4],
            "q75": ratios[(3 * len(ratios)) // 4],
            "median_ci95": median_ci(ratios),
        }
    for name in names:
        stats = loops[name].close()
        if stats is not None:
            out[name]["stats"] = stats
    return out


def median_ci(sorted_values: list[float]) -> list[float]:
    """Distribution-free 95% confidence interval of the median: the order statistics at
    n/2 -+ 0.98 sqrt(n) (normal approximation to the binomial), clamped to the sample."""
    n = len(sorted_values)
    half = 0.98 * n**0.5
    lo = max(0, int(n / 2 - half))
    hi = min(n - 1, int(n / 2 + half + 0.5))
    return [sorted_values[lo], sorted_values[hi]]


def hook_seconds(opt) -> float:
    return opt.stats()["hook_seconds"] if isinstance(opt, RapidFireOptimizer) else 0.0


def merge_rounds(rounds: list[dict]) -> dict:
    """One variant's rounds -> median/min/max step ms over all timed steps, the largest peak."""
    timed = sorted(t for r in rounds for t in r["times_ms"])
    peaks = [r["peak_gib"] for r in rounds if r["peak_gib"] is not None]
    result = {
        "step_ms_p50": statistics.median(timed),
        "step_ms_min": timed[0],
        "step_ms_max": timed[-1],
        "timed_steps": len(timed),
        "opt_ms_p50": statistics.median(t for r in rounds for t in r["opt_ms"]),
        "micro_batches": rounds[0]["micro_batches"],
        "peak_gib": max(peaks) if peaks else None,
        "held_at_step_gib": max(
            (r["held_at_step_gib"] for r in rounds if r["held_at_step_gib"]), default=None
        ),
        # per-round medians, for paired comparisons across variants that ran in the same round
        "round_ms_p50": [statistics.median(r["times_ms"]) for r in rounds],
    }
    if "stats" in rounds[-1]:
        result["stats"] = rounds[-1]["stats"]
    return result


def reference_of(name: str) -> str:
    """The plain torch loop a variant is compared with: same micro-batches, same checkpointing."""
    if name.endswith("_accum"):
        return "torch_adamw_accum"
    if name.endswith("_ckpt"):
        return "torch_adamw_ckpt"
    if name.startswith("rf_clip"):
        return "torch_adamw_clip"
    if "8bit" in name:
        return "bnb_adamw8bit"
    return "torch_adamw"


def add_paired_ratios(variants: dict) -> None:
    """``vs_reference``: step time / its reference's, per round (both ran in the same round, minutes
    apart at most), as median/min/max over rounds. A ratio under 1 is faster than the reference."""
    for name, r in variants.items():
        ref = variants.get(reference_of(name))
        if ref is None or ref is r:
            continue
        ratios = [a / b for a, b in zip(r["round_ms_p50"], ref["round_ms_p50"])]
        r["vs_reference"] = {
            "reference": reference_of(name),
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }


def snapshot_costs(shape: dict, device: str) -> dict:
    """Seconds for one snapshot (device, host) and one restore of 1.1B params + AdamW state."""
    model = build_model(shape, device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device), labels=None).logits.sum().backward()
    opt.step()
    out = {}
    for where in ("device", "host"):
        snap = Snapshot(where)
        snap.capture(params, opt, 0)  # allocates the buffers once
        sync(device)
        start = time.perf_counter()
        snap.capture(params, opt, 1)
        snap.wait()
        sync(device)
        out[f"snapshot_{where}_ms"] = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        snap.restore(params, opt)
        sync(device)
        out[f"rollback_{where}_ms"] = 1e3 * (time.perf_counter() - start)
        out[f"snapshot_{where}_gib"] = snap.nbytes / 2**30
        del snap
    return out


def summary(variants: dict) -> str:
    """A plain-text table: step time, optimizer work (step() + bucket steps in the hooks), peak memory,
    bucket count."""
    lines = [
        f"{'variant':28s} {'p50 ms':>9s} {'min ms':>9s} {'opt ms':>9s} {'peak GiB':>9s} {'held GiB':>9s} "
        f"{'vs torch':>9s} {'buckets':>8s}"
    ]
    for name, r in variants.items():
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        held = "-" if r.get("held_at_step_gib") is None else f"{r['held_at_step_gib']:.2f}"
        ratio = "-" if r.get("vs_reference") is None else f"{r['vs_reference']['median']:.3f}"
        buckets = r.get("stats", {}).get("pipeline_buckets") or "-"
        lines.append(
            f"{name:28s} {r['step_ms_p50']:9.1f} {r['step_ms_min']:9.1f} {r['opt_ms_p50']:9.2f} {peak:>9s} "
            f"{held:>9s} {ratio:>9s} {buckets!s:>8s}"
        )
    return "\n".join(lines)


def interleaved_summary(variants: dict) -> str:
    lines = [
        "interleaved (every variant resident, one step each per round, rotating order):",
        f"{'variant':28s} {'p50 ms':>9s} {'opt ms':>9s} {'vs ref':>8s} {'ci95 of the median':>20s} {'middle half':>16s}",
    ]
    for name, r in variants.items():
        ref = r.get("vs_reference")
        tail = (
            ""
            if ref is None
            else (
                f"{ref['median']:8.3f} {ref['median_ci95'][0]:9.3f}-{ref['median_ci95'][1]:.3f} "
                f"{ref['q25']:9.3f}-{ref['q75']:.3f}  vs {ref['reference']}"
            )
        )
        lines.append(f"{name:28s} {r['step_ms_p50']:9.1f} {r['opt_ms_p50']:9.2f} {tail}")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["variants"])
    v = results["variants"]
    inter = results.get("interleaved") or {}
    paired = [n for n in names if "vs_reference" in inter.get(n, {})]
    fig, axes = plt.subplots(1, 4 if paired else 3, figsize=(21 if paired else 16, 6))
    axes[0].barh(names, [v[n]["step_ms_p50"] for n in names])
    axes[0].set_xlabel("step time, ms (median, sequential rounds)")
    for ax, key, label in (
        (axes[1], "peak_gib", "peak allocated, GiB"),
        (axes[2], "held_at_step_gib", "allocated just before step(), GiB"),
    ):
        if all(v[n].get(key) is not None for n in names):
            ax.barh(names, [v[n][key] for n in names])
            ax.set_xlabel(label)
        ax.set_yticks([])
    if paired:
        ax = axes[3]
        med = [inter[n]["vs_reference"]["median"] for n in paired]
        lo = [m - inter[n]["vs_reference"]["median_ci95"][0] for m, n in zip(med, paired)]
        hi = [inter[n]["vs_reference"]["median_ci95"][1] - m for m, n in zip(med, paired)]
        ax.errorbar(med, range(len(paired)), xerr=[lo, hi], fmt="o", capsize=4)
        ax.set_yticks(range(len(paired)), [f"{n} / {inter[n]['vs_reference']['reference']}" for n in paired])
        ax.yaxis.tick_right()
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", lw=1)
        ax.axvline(1.03, color="tab:red", lw=1, ls="--", label="+3%")
        ax.set_xlabel("step time / reference's, interleaved steps (median, 95% CI)")
        ax.legend(loc="lower right")
    fig.suptitle(f"RapidFireOptimizer vs torch AdamW — {results['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model on the CPU, seconds (= --preset smoke)"
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape: full (1.1B Llama, CUDA; the default), smoke (tiny, CPU), cpu_small "
        "(hidden 256, 8 layers, CPU)",
    )
    parser.add_argument(
        "--bucket-mb",
        nargs="*",
        type=float,
        default=list(DEFAULT_BUCKETS),
        help="pipeline_bucket_mb values of the rf_pipeline_bucket<N> variants (0: one step per parameter)",
    )
    parser.add_argument("--only", nargs="*", help="run only these variants")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default: the preset's)")
    parser.add_argument("--batch", type=int, help="sequences per micro-batch (default: the preset's)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    parser.add_argument("--no-snapshot", action="store_true", help="skip the snapshot/rollback timing")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants round-robin this many times and pool their timed steps (steadier on a "
        "shared CPU)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU runs)")
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the rounds, keep every chosen variant resident and run STEPS rounds of one step each, "
        "in rotating order: per-step paired ratios to the reference (results['interleaved'])",
    )
    args = parser.parse_args(argv)
    preset = "smoke" if args.smoke else args.preset or "full"
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = dict(PRESETS[preset])
    for key in ("steps", "batch", "seq"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    device = "cuda" if preset == "full" and torch.cuda.is_available() else "cpu"
    import transformers

    results = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "preset": preset,
        "shape": {k: str(v) for k, v in shape.items()},
        "torch_threads": torch.get_num_threads(),
        "variants": {},
    }
    table = variants(device, shape["accum"], args.bucket_mb)
    unknown = sorted(set(args.only or ()) - set(table))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(table)}")
    chosen = {n: v for n, v in table.items() if not args.only or n in args.only}
    rounds: dict[str, list[dict]] = {n: [] for n in chosen}
    names = list(chosen)
    results["orders"] = []
    for r in range(max(1, args.rounds)):
        # rotate the order each round: a variant's position (what ran before it, allocator and clock
        # state) is then not tied to the variant; the runs of 2026-11-30 used one fixed order
        k = (r * max(1, len(names) // max(1, args.rounds))) % len(names)
        order = names[k:] + names[:k]
        results["orders"].append(order)
        for name in order:
            make_opt, micro, observe, *ckpt = chosen[name]
            rounds[name].append(run_variant(shape, device, make_opt, micro, observe, *ckpt))
    for name in chosen:
        results["variants"][name] = merge_rounds(rounds[name])
    add_paired_ratios(results["variants"])
    for name in chosen:
        print(
            name, json.dumps({k: v for k, v in results["variants"][name].items() if k != "stats"}), flush=True
        )
    print(summary(results["variants"]), flush=True)
    if args.interleave > 0:
        results["interleaved"] = run_interleaved(shape, device, chosen, args.interleave)
        print(interleaved_summary(results["interleaved"]), flush=True)
    if not args.no_snapshot:
        results["snapshot"] = snapshot_costs(shape, device)
        print("snapshot", json.dumps(results["snapshot"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", results)
    chart(results, args.out / "results.png")
    return results


if __name__ == "__main__":
    main()
