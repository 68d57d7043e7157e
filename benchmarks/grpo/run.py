"""Stock ``trl.GRPOTrainer`` against ``enable_rapidfire(GRPOTrainer(...))``, same model, data and seed.

Workload: a random-init Llama of the 1.1B shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, vocab 32000)
built on the GPU in bf16, 128-token prompts, 8 generations of 256 tokens per prompt, batch 64, a rule-based
reward (fraction of vowels), beta 0. Each variant runs in its own process (fresh CUDA allocator, its own
peak) for ``--steps`` optimizer steps, one after another on the same GPU, so every ratio is to the stock run
of the same call.

Variants (``--variants``, comma-separated; default all three):

- ``stock``: ``GRPOTrainer`` with TRL's defaults (``optim="adamw_torch_fused"``, ``gradient_checkpointing=True``).
- ``rapidfire``: ``enable_rapidfire(trainer, optimizer_kwargs={"rollback": ..., "snapshot": ...})``
  (``--rollback``, ``--snapshot``), balanced config.
- ``rapidfire_lowmem``: the library's low-memory switch,
  ``enable_rapidfire(trainer, config={"memory": {"optimization": "aggressive", "lowmem": "on_8bit_embedding"}},
  optimizer_kwargs={"rollback": "off"})`` with ``GRPOConfig(optim="adamw_8bit", max_grad_norm=0.0,
  gradient_checkpointing=False)`` (the switch requires both and applies its own chunked checkpointing). It
  changes the math: 8-bit AdamW state (embedding included) and no clipping. On the CPU, where bitsandbytes
  cannot run, it uses ``lowmem="on"`` with an explicit torch AdamW (recorded as the fallback).

Reported per variant: tokens/s (prompt + completion tokens, TRL's ``num_input_tokens_seen``) over all steps
and over steps 2.. (steady state), the first step's time and its excess over the median later step
(compilation, CUDA-graph capture, warm-up); peak allocated and reserved GiB, overall and per phase of the
step (``phases.PhaseMemory``); time per phase; the loss and reward curves; ratios to stock.

Usage:
    python benchmarks/grpo/run.py --out DIR                                    # GPU, all three, ~4 minutes
    python benchmarks/grpo/run.py --out DIR --variants stock,rapidfire_lowmem  # the README's GRPO row
    python benchmarks/grpo/run.py --out /tmp/grpo-smoke --smoke                # CPU, tiny model, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # phases.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from phases import PhaseMemory, speed  # noqa: E402

from benchmarks.common import environment, save_figure, write_json  # noqa: E402
from rapidfire_hf.utils.units import GIB  # noqa: E402

VARIANTS = ("stock", "rapidfire", "rapidfire_lowmem")
# run only when named: a rapidfire variant under the previous memory.release_after_rollout default ("always":
# the allocator's cache released after every rollout), set on the installed memory callback
ALWAYS_RELEASE = "_alwaysrelease"
KNOWN = VARIANTS + tuple(v + ALWAYS_RELEASE for v in VARIANTS if v != "stock")
DESCRIPTIONS = {
    "stock": "trl.GRPOTrainer with TRL's defaults (optim adamw_torch_fused, gradient_checkpointing=True)",
    "rapidfire": "enable_rapidfire(GRPOTrainer(...)) with the balanced config and the trainer's own optimizer "
    "(adamw_torch_fused) inside RapidFireOptimizer",
    "rapidfire_alwaysrelease": "the rapidfire variant with memory.release_after_rollout='always' (the default "
    "until 2026-12-04)",
    "rapidfire_lowmem_alwaysrelease": "the rapidfire_lowmem variant with memory.release_after_rollout='always' "
    "(the default until 2026-12-04)",
    "rapidfire_lowmem": "enable_rapidfire(GRPOTrainer(...), config memory.lowmem='on_8bit_embedding'): 8-bit AdamW "
    "state (embedding included), no clipping, chunked checkpointing with layer inputs offloaded to pinned host "
    "memory, chunked rollout prefill, the rollout engine released after each rollout",
}
# what each variant sets beyond stock, and where the setting comes from
SETTINGS = {
    "stock": [],
    "rapidfire": [],  # filled in main() with the --rollback / --snapshot values
    "rapidfire_lowmem": [
        {
            "setting": 'GRPOConfig(optim="adamw_8bit", max_grad_norm=0.0)',
            "source": "stock TRL options",
            "effect": "8-bit AdamW state; no clipping (memory.lowmem refuses to run without both)",
        },
        {
            "setting": "GRPOConfig(gradient_checkpointing=False)",
            "source": "stock TRL",
            "effect": "memory.lowmem's chunked, offloaded checkpointing replaces HF's",
        },
        {
            "setting": 'enable_rapidfire(config={"memory": {"optimization": "aggressive", "lowmem": '
            '"on_8bit_embedding"}}, optimizer_kwargs={"rollback": "off"})',
            "source": "rapidfire_hf",
            "effect": "chunked checkpointing with host-offloaded layer inputs (pooled pinned buffers), chunked "
            "prefill, the rollout engine released after each rollout, bitsandbytes' per-parameter syncs skipped, "
            "the embedding's AdamW state in 8 bits; the gradient pipeline frees each bucket's gradients in backward",
        },
    ],
}
FULL = dict(
    hidden=2048,
    layers=22,
    heads=32,
    kv_heads=4,
    intermediate=5632,
    vocab=32000,
    prompt_len=128,
    completion_len=256,
    batch=64,
    steps=10,
)
SMOKE = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=None,
    prompt_len=16,
    completion_len=8,
    batch=16,
    steps=2,
)
GENERATIONS = 8


def build_tokenizer(vocab: int | None):
    """The demo's char tokenizer, padded with filler tokens up to ``vocab`` (decoded as ``<|id|>``)."""
    from rapidfire_hf.demo import build_char_tokenizer

    return build_char_tokenizer(vocab)


def prompts(n: int, length: int, seed: int = 0):
    """``n`` prompts of exactly ``length`` characters (= tokens): ``task: <random letters> ->``."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    body = length - len("task:  ->")
    return Dataset.from_dict(
        {
            "prompt": [
                "task: " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(body)) + " ->"
                for _ in range(n)
            ]
        }
    )


def build_model(shape: dict, tok, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidfire_hf.demo.shapes import config_kwargs

    config = LlamaConfig(
        **{**config_kwargs(shape), "vocab_size": shape["vocab"] or len(tok)},
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the host
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16) if device == "cuda" else model


def bnb_unusable(device: str) -> str | None:
    """``None`` when bitsandbytes' 8-bit AdamW can run here, else why it cannot."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    if device != "cuda":
        return "CPU run: bitsandbytes' 8-bit optimizers need a GPU"
    return None


def make_trainer(variant: str, smoke: bool, steps: int, optimizer_kwargs: dict):
    """The GRPOTrainer of ``variant``, with enable_rapidfire applied for the rapidfire variants; also returns
    the bitsandbytes fallback reason (``None`` when 8-bit AdamW runs)."""
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf import enable_rapidfire
    from rapidfire_hf.demo import vowel_reward

    shape = dict(SMOKE if smoke else FULL, steps=steps)
    device = "cpu" if smoke else "cuda"
    tok = build_tokenizer(shape["vocab"])
    always_release = variant.endswith(ALWAYS_RELEASE)
    variant = variant.removesuffix(ALWAYS_RELEASE)
    lowmem = variant == "rapidfire_lowmem"
    fallback = bnb_unusable(device) if lowmem else None
    extra = {}
    if lowmem:
        extra = dict(
            optim="adamw_torch" if fallback else "adamw_8bit",
            max_grad_norm=0.0,
            gradient_accumulation_steps=1,
            gradient_checkpointing=False,  # memory.lowmem applies its own; the Trainer must not add HF's
        )
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"grpo-{variant}-"),  # nothing is saved; keep --out clean
        max_steps=steps,
        per_device_train_batch_size=shape["batch"],
        num_generations=GENERATIONS,
        max_completion_length=shape["completion_len"],
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        bf16=not smoke,
        use_cpu=smoke,
        beta=0.0,
        **extra,
    )
    trainer = GRPOTrainer(
        model=build_model(shape, tok, device),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompts(shape["batch"] * steps, shape["prompt_len"]),
        processing_class=tok,
    )
    if variant == "rapidfire":
        trainer = enable_rapidfire(trainer, optimizer_kwargs=optimizer_kwargs)
    elif lowmem:
        if fallback:  # memory.lowmem="on" needs an 8-bit optim or an explicitly chosen optimizer
            trainer.optimizer_cls_and_kwargs = trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
        mode = "on" if fallback else "on_8bit_embedding"
        trainer = enable_rapidfire(
            trainer,
            config={"memory": {"optimization": "aggressive", "lowmem": mode}},
            optimizer_kwargs={"rollback": "off"},
        )
    if always_release:
        from rapidfire_hf.integrations.parts import installed_parts

        installed_parts(trainer)["memory"].release_after_rollout = "always"
    return trainer, shape, fallback


def lowmem_report(trainer, fallback: str | None) -> dict:
    """What the low-memory switch did: optimizer, pipelined steps, offloaded bytes, rollout releases."""
    from rapidfire_hf.integrations.parts import find_rapidfire_optimizer, installed_parts

    args, parts = trainer.args, installed_parts(trainer)
    rf_opt = find_rapidfire_optimizer(trainer.optimizer)
    inner = rf_opt.inner
    lowmem, rollout = parts["lowmem"], parts.get("rollout")
    return {
        "optim": args.optim.value if hasattr(args.optim, "value") else str(args.optim),
        "inner_optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_fallback": fallback,  # None: the 8-bit optimizer ran
        "rollback": rf_opt.rollback,
        "max_grad_norm": args.max_grad_norm,
        # pipelined_steps: windows stepped in backward (gradients freed); deferred_steps: why not
        "optimizer_stats": {
            k: v
            for k, v in rf_opt.stats().items()
            if k in ("steps", "pipelined_steps", "deferred_steps", "bucket_steps", "pipeline_buckets")
        },
        "activation_offload": lowmem.offloader.stats.as_dict(),
        "host_buffer_pool_gib": lowmem.offloader.pooled_bytes() / GIB,
        "bnb_sync_skipped_on_default_stream": lowmem.bnb_sync_skipped,
        "embedding_8bit_optimizer": lowmem.embedding_8bit,
        "optimizer_state_gib": state_gib(inner),
        "embedding_state_dtypes": embedding_state_dtypes(trainer.model, inner),
        "rollout_released_after_each_rollout": rollout is not None and rollout.release_after_rollout,
        "rollout": rollout.stats() if rollout is not None else None,
        "rollout_hook_seconds": rollout.timings if rollout is not None else {},
    }


def run_variant(variant: str, smoke: bool, steps: int, optimizer_kwargs: dict) -> dict:
    """Train one variant in this process and return its measurements."""
    import torch
    from transformers import TrainerCallback

    trainer, shape, fallback = make_trainer(variant, smoke, steps, optimizer_kwargs)
    step_times: list[float] = []
    step_tokens: list[int] = []

    class StepTimer(TrainerCallback):
        seen = 0

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t)
            step_tokens.append(state.num_input_tokens_seen - self.seen)
            self.seen = state.num_input_tokens_seen

    trainer.add_callback(StepTimer())
    phases = PhaseMemory()
    phases.install(trainer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    phases.start()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    tokens = trainer.state.num_input_tokens_seen
    generated = sum(h["completions/mean_length"] * shape["batch"] for h in logs)
    peaks = phases.overall_peak()
    result = {
        "variant": variant,
        "steps": len(step_times),
        "wall_s": wall,
        "step_s": step_times,
        "step_tokens": step_tokens,
        "tokens": tokens,
        "tokens_per_sec": tokens / wall,  # over the wall time of train(); "speed" has exact per-step spans
        "speed": speed(step_times, step_tokens),
        "generated_tokens_per_sec": generated / wall,
        "loss": [h["loss"] for h in logs],
        "reward": [h["reward"] for h in logs],
        "peak_allocated_gib": peaks[0] / GIB if peaks else None,
        "peak_reserved_gib": peaks[1] / GIB if peaks else None,
        "memory_by_phase": phases.report(),
        "time_by_phase": phases.time_report(),
        "host_memory": host_memory_stats(),
    }
    if variant != "stock":
        from rapidfire_hf.integrations.parts import installed_parts

        result["installed_parts"] = sorted(installed_parts(trainer))
        result["release_after_rollout"] = installed_parts(trainer)["memory"].release_after_rollout
        result["rapidfire_metrics"] = {k: v for k, v in logs[-1].items() if k.startswith("rapidfire/")}
    if variant.startswith("rapidfire_lowmem"):
        result["lowmem"] = lowmem_report(trainer, fallback)
    return result


def host_memory_stats() -> dict | None:
    """torch's pinned host allocator over the run (CUDA only): blocks created / returned to the driver and the
    seconds spent doing it (each CUDA-graph capture empties this cache, so a pinned buffer that is not kept in a
    pool is created again at every step)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        stats = torch.cuda.memory.host_memory_stats()
    except Exception as exc:  # an older torch without the call
        return {"error": repr(exc)}
    out = {k: stats.get(k) for k in ("num_host_alloc", "num_host_free")}
    for key in ("host_alloc_time.total", "host_free_time.total"):  # microseconds in torch
        if stats.get(key) is not None:
            out[key.replace(".total", "_s")] = stats[key] / 1e6
    for key in ("allocated_bytes.current", "allocated_bytes.peak"):
        if stats.get(key) is not None:
            out[key.replace(".", "_").replace("bytes", "gib")] = stats[key] / GIB
    return out


def state_gib(optimizer) -> float:
    """GiB of the optimizer's state tensors (each storage once)."""
    seen = {}
    for state in optimizer.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage") and v.device.type != "meta":
                st = v.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) / GIB


def embedding_state_dtypes(model, optimizer) -> dict:
    """dtype of each state tensor of the input embedding's weight (uint8 moments: 8-bit state)."""
    weight = model.get_input_embeddings().weight
    state = optimizer.state.get(weight, {})
    return {k: str(v.dtype).replace("torch.", "") for k, v in state.items() if hasattr(v, "dtype")}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = results["runs"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 8))
    names = list(runs)
    palette = {
        "stock": "tab:gray",
        "rapidfire": "tab:red",
        "rapidfire_lowmem": "tab:orange",
    }
    colors = [palette.get(n, "tab:olive") for n in names]
    x = np.arange(len(names))
    spans = (("all_steps", "all steps", 0.55), ("steady_state_steps_2_on", "steps 2.. (steady state)", 1.0))
    for i, (key, label, alpha) in enumerate(spans):
        vals = [(runs[n]["speed"][key] or {}).get("tokens_per_sec", 0.0) for n in names]
        bars = axes[0, 0].bar(x + (i - 0.5) * 0.4, vals, 0.4, color=colors, alpha=alpha, label=label)
        axes[0, 0].bar_label(bars, labels=[f"{v:,.0f}" for v in vals], fontsize=7)
    axes[0, 0].set_xticks(x, names)
    axes[0, 0].set_title("tokens / s (prompt + completion): all steps (light), steps 2.. (dark)")
    mem = [runs[n]["peak_allocated_gib"] or 0.0 for n in names]
    bars = axes[0, 1].bar(names, mem, color=colors)
    half = None
    if any(mem):
        axes[0, 1].bar_label(bars, labels=[f"{v:.2f}" for v in mem])
        if "stock" in runs and runs["stock"]["peak_allocated_gib"]:
            half = runs["stock"]["peak_allocated_gib"] / 2
            axes[0, 1].axhline(half, color="k", ls="--", lw=1, label="1/2 of stock")
            axes[0, 1].legend()
    axes[0, 1].set_title("peak allocated GiB" + (" (n/a on CPU)" if not any(mem) else ""))
    shown = ("generation", "loss_forward", "backward", "optimizer_step")
    width = 0.8 / len(shown)
    for j, phase in enumerate(shown):
        vals = [(runs[n]["memory_by_phase"]["peak_allocated_gib"] or {}).get(phase, 0.0) for n in names]
        axes[0, 2].bar(x + (j - (len(shown) - 1) / 2) * width, vals, width, label=phase)
    if half:
        axes[0, 2].axhline(half, color="k", ls="--", lw=1)
    axes[0, 2].set_xticks(x, names)
    axes[0, 2].legend(fontsize=8)
    axes[0, 2].set_title("peak allocated GiB by phase" + (" (n/a on CPU)" if not any(mem) else ""))
    for ax in axes[0]:
        ax.tick_params(axis="x", labelsize=8)
    for key, ax in (("loss", axes[1, 0]), ("reward", axes[1, 1]), ("step_s", axes[1, 2])):
        for n, c in zip(names, colors):
            ax.plot(range(1, len(runs[n][key]) + 1), runs[n][key], marker="o", label=n, color=c)
        ax.set_title("step time (s)" if key == "step_s" else key)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[1, 2].set_yscale("log")
    fig.suptitle(f"GRPO, {results['workload']} on {results['environment']['device']}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def ratios_to_stock(run: dict, stock: dict) -> dict:
    def tps(r, key):
        span = r["speed"][key]
        return span["tokens_per_sec"] if span else None

    def ratio(a, b):
        return a / b if a and b else None

    out = {
        "tokens_per_sec": run["tokens_per_sec"] / stock["tokens_per_sec"],  # over the wall time of train()
        # exact per-step tokens over the summed step times
        "tokens_per_sec_all_steps": ratio(tps(run, "all_steps"), tps(stock, "all_steps")),
        "tokens_per_sec_steady_state_steps_2_on": ratio(
            tps(run, "steady_state_steps_2_on"), tps(stock, "steady_state_steps_2_on")
        ),
        "peak_allocated": ratio(run["peak_allocated_gib"], stock["peak_allocated_gib"]),
    }
    out["target_met"] = {
        "speed_steady_state_ge_3x": None
        if out["tokens_per_sec_steady_state_steps_2_on"] is None
        else out["tokens_per_sec_steady_state_steps_2_on"] >= 3,
        "speed_all_steps_ge_3x": None
        if out["tokens_per_sec_all_steps"] is None
        else out["tokens_per_sec_all_steps"] >= 3,
        "peak_allocated_le_half": None if out["peak_allocated"] is None else out["peak_allocated"] <= 0.5,
    }
    return out


def summary_lines(runs: dict, by_variant: dict) -> list[str]:
    """One block of plain text per variant: speed over both spans, first step, memory by phase."""
    lines = []
    for name, run in runs.items():
        sp = run["speed"]
        steady = sp["steady_state_steps_2_on"]
        lines.append(
            f"{name}: {sp['all_steps']['tokens_per_sec']:,.0f} tok/s over all {sp['all_steps']['steps']} steps; "
            + (f"{steady['tokens_per_sec']:,.0f} tok/s over steps 2.. (steady state); " if steady else "")
            + f"first step {sp['first_step_s']:.1f} s"
            + (
                f" ({sp['first_step_excess_s']:+.1f} s vs the median later step {sp['median_step_s_steps_2_on']:.2f} s)"
                if steady
                else ""
            )
        )
        times = (run.get("time_by_phase") or {}).get("median_steps_2_on")
        if times:
            kind = "gpu_s" if times["gpu_s"] else "cpu_s"
            lines.append(
                f"  median time per phase, steps 2.. ({'device stream' if kind == 'gpu_s' else 'host'} s): "
                + ", ".join(f"{k} {v:.3f}" for k, v in times[kind].items())
            )
        phases = run["memory_by_phase"]["peak_allocated_gib"]
        if run["peak_allocated_gib"] is not None:
            lines.append(
                f"  peak allocated {run['peak_allocated_gib']:.2f} GiB (reserved {run['peak_reserved_gib']:.2f}); "
                + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
            )
        if name in by_variant:
            r = by_variant[name]
            lines.append(
                "  vs stock: "
                + ", ".join(
                    f"{k} {v:.2f}x" if isinstance(v, float) else f"{k} n/a"
                    for k, v in r.items()
                    if k
                    in (
                        "tokens_per_sec_all_steps",
                        "tokens_per_sec_steady_state_steps_2_on",
                        "peak_allocated",
                    )
                )
                + f"; target met: {r['target_met']}"
            )
    return lines


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in KNOWN]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; choose from {', '.join(KNOWN)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and chart.png")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=list(VARIANTS),
        help=f"comma-separated variants to run, in order (default: {','.join(VARIANTS)}; also "
        f"{', '.join(KNOWN[len(VARIANTS) :])}: the previous memory.release_after_rollout default)",
    )
    parser.add_argument(
        "--rollback", choices=("auto", "off"), default="auto", help="RapidFireOptimizer rollback (rapidfire)"
    )
    # default host: a device snapshot of weights + Adam state adds about 3x the weights to the GPU peak
    parser.add_argument(
        "--snapshot",
        choices=("device", "host"),
        default="host",
        help="where rollback snapshots live (rapidfire)",
    )
    parser.add_argument("--variant", choices=KNOWN, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    steps = args.steps or shape["steps"]
    args.out.mkdir(parents=True, exist_ok=True)
    optimizer_kwargs = {"rollback": args.rollback, "snapshot": args.snapshot}
    if args.variant:
        write_json(
            args.out / f"{args.variant}.json", run_variant(args.variant, args.smoke, steps, optimizer_kwargs)
        )
        return None
    runs = {}
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--out", str(args.out), "--steps", str(steps), "--variant", variant]
        cmd += ["--rollback", args.rollback, "--snapshot", args.snapshot] + (
            ["--smoke"] if args.smoke else []
        )
        subprocess.run(cmd, check=True, env=os.environ.copy())
        runs[variant] = json.loads((args.out / f"{variant}.json").read_text())
    settings = dict(SETTINGS)
    settings["rapidfire"] = [
        {"setting": f"enable_rapidfire(optimizer_kwargs={optimizer_kwargs})", "source": "rapidfire_hf"}
    ]
    previous = {
        "setting": "memory callback release_after_rollout='always'",
        "source": "benchmarks/grpo/run.py",
    }
    for base in VARIANTS[1:]:
        settings[base + ALWAYS_RELEASE] = [*settings[base], previous]
    variants = {n: {"description": DESCRIPTIONS[n], "settings": settings[n]} for n in runs}
    stock = runs.get("stock")
    by_variant = {n: ratios_to_stock(r, stock) for n, r in runs.items() if n != "stock"} if stock else {}
    env = environment(smoke=args.smoke)
    env["device"] = "cpu (smoke)" if args.smoke else env["gpu"]
    env["command"] = " ".join(
        [Path(sys.executable).name, "benchmarks/grpo/run.py", *(sys.argv[1:] if argv is None else argv)]
    )
    results = {
        "command": env["command"],
        "date": env["date"],
        "environment": env,
        "workload": (
            f"Llama hidden {shape['hidden']} x {shape['layers']} layers, {shape['prompt_len']}-token prompts, "
            f"{GENERATIONS} x {shape['completion_len']} completion tokens, batch {shape['batch']}"
        ),
        "variants": variants,
        "runs": runs,
        "ratios_by_variant": by_variant,
        "target": "tokens_per_sec ratio >= 3 and peak_allocated ratio <= 0.5 (vs stock); the speed ratio is "
        "given over all steps and over steps 2.. (steady state, without the one-time first-step work)",
        "summary": summary_lines(runs, by_variant),
    }
    write_json(args.out / "results.json", results)
    plot(results, args.out / "chart.png")
    print("\n".join(results["summary"]))
    return results


if __name__ == "__main__":
    main()
