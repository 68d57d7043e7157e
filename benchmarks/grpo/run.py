"""Stock ``trl.GRPOTrainer`` against ``enable_rapidfire(GRPOTrainer(...))``, same model, data and seed.

The workload of DESIGN.md: a random-init Llama of the 1.1B shape (hidden 2048, 22 layers, 32 heads,
4 KV heads, vocab 32000) built on the GPU in bf16, 128-token prompts, 8 generations of 256 tokens per
prompt, a rule-based reward (fraction of vowels), beta 0. Each variant runs in its own process (fresh
CUDA allocator, its own peak), for ``--steps`` optimizer steps.

Variants (``--variants``, comma-separated; default all three):

- ``stock``: ``GRPOTrainer`` with TRL's defaults (``optim="adamw_torch_fused"``, ``gradient_checkpointing=True``).
- ``rapidfire``: the same trainer through ``enable_rapidfire(trainer, optimizer_kwargs={"rollback": ...,
  "snapshot": ...})`` (``--rollback``, ``--snapshot``), balanced config.
- ``rapidfire_lowmem``: the memory-saving settings, each listed with its source (stock TRL option or
  rapidfire_hf) under ``results.json`` -> ``variants`` -> ``rapidfire_lowmem``: bitsandbytes' 8-bit AdamW
  as the inner optimizer (``optim="adamw_8bit"``; plain ``adamw_torch`` when bitsandbytes is missing or on
  the CPU, recorded as a fallback), gradient pipeline on with ``gradient_accumulation_steps=1``,
  ``rollback="off"`` (no snapshot), ``memory.optimization: aggressive`` with
  ``apply_selective_checkpointing(model, "aggressive")`` called here (``enable_rapidfire`` does not apply
  checkpointing itself), and the rollout engine's KV cache released after every rollout.

Reported per variant: tokens/s (prompt + completion tokens, TRL's ``num_input_tokens_seen``, over the
wall time of training; also over steps 2.. to leave out one-time warm-up such as CUDA-graph capture),
generated tokens/s, peak allocated and reserved GiB, and the loss and reward curves.

Usage:
    python benchmarks/grpo/run.py --out benchmarks/grpo/results/h200          # GPU, all three, < 8 minutes
    python benchmarks/grpo/run.py --out /tmp/grpo-smoke --smoke               # CPU, tiny model, ~1-2 minutes
    python benchmarks/grpo/run.py --out /tmp/g --variants stock,rapidfire_lowmem
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

VARIANTS = ("stock", "rapidfire", "rapidfire_lowmem")
# what each variant changes, and whether it is an option of stock TRL/transformers or of rapidfire_hf
# (written to results.json; the lowmem optimizer line is completed at run time, see lowmem_settings)
DESCRIPTIONS = {
    "stock": {
        "description": "trl.GRPOTrainer with TRL's defaults (optim adamw_torch_fused, gradient_checkpointing=True)",
        "settings": [],
    },
    "rapidfire": {
        "description": "enable_rapidfire(GRPOTrainer(...)) with the balanced config and the trainer's own "
        "optimizer (adamw_torch_fused) inside RapidFireOptimizer",
        "settings": [],  # filled in main() with the --rollback / --snapshot values
    },
    "rapidfire_lowmem": {
        "description": "enable_rapidfire(GRPOTrainer(...)) tuned for peak memory: 8-bit AdamW inner optimizer, "
        "gradient pipeline with gradient_accumulation_steps=1, no rollback snapshot, full activation "
        "checkpointing applied by rapidfire_hf, rollout KV cache released after each rollout",
        "settings": [],  # filled by lowmem_settings()
    },
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
    steps=6,
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

    config = LlamaConfig(
        vocab_size=shape["vocab"] or len(tok),
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
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


def lowmem_settings(fallback: str | None, keep_rollout_cache: bool) -> list[dict]:
    """What ``rapidfire_lowmem`` sets, each with its source: a stock TRL/transformers option or ours."""
    optim = "adamw_torch" if fallback else "adamw_8bit"
    return [
        {
            "setting": f'GRPOConfig(optim="{optim}")',
            "source": "stock TRL (TrainingArguments.optim)",
            "effect": (
                f"plain torch AdamW: fallback, {fallback}"
                if fallback
                else "bitsandbytes 8-bit AdamW (optim_bits=8; transformers keeps nn.Embedding state in 32 "
                "bits): about 2 bytes of optimizer state per parameter instead of 4 (bf16 AdamW)"
            ),
            "fallback": fallback,
        },
        {
            "setting": "enable_rapidfire wraps that optimizer in RapidFireOptimizer, gradient pipeline on "
            "(config gradient.pipeline: true, the default)",
            "source": "rapidfire_hf",
            "effect": "each bucket of parameters is stepped during backward and its gradients freed; "
            "enable_rapidfire has no optimizer-name option (optimizer_kwargs={'optimizer': ...} collides "
            "with the instance it wraps), so the inner optimizer is chosen with the trainer's own optim",
        },
        {
            "setting": "GRPOConfig(gradient_accumulation_steps=1)",
            "source": "stock TRL (also its default)",
            "effect": "every backward closes an optimizer window, so no gradient outlives its bucket",
        },
        {
            "setting": 'enable_rapidfire(optimizer_kwargs={"rollback": "off"})',
            "source": "rapidfire_hf",
            "effect": "no health checks and no rollback snapshot (a device snapshot is a full copy of "
            "weights + optimizer state; the rapidfire variant keeps a host one)",
        },
        {
            "setting": 'enable_rapidfire(config={"memory": {"optimization": "aggressive"}})',
            "source": "rapidfire_hf",
            "effect": "in enable_rapidfire this only makes MemoryCompactionCallback compact more eagerly; "
            "it does not apply activation checkpointing",
        },
        {
            "setting": 'rapidfire_hf.memory.apply_selective_checkpointing(model, "aggressive"), called by '
            "this benchmark before enable_rapidfire",
            "source": "rapidfire_hf (applied here, not by enable_rapidfire)",
            "effect": '"aggressive" is full checkpointing of every decoder layer (non-reentrant), the same '
            "recompute policy as TRL's default gradient_checkpointing=True that stock uses",
        },
        {
            "setting": 'GRPOConfig(gradient_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": False})',
            "source": "stock TRL",
            "effect": "the Trainer does not put its own checkpointing over ours; TRL re-enables "
            "checkpointing with these kwargs after each rollout, which matches ours",
        },
        {
            "setting": "rollout KV cache kept between rollouts"
            if keep_rollout_cache
            else "RolloutEngine.release() after every rollout (hooked in by this benchmark; "
            "--lowmem-keep-rollout-cache turns it off)",
            "source": "rapidfire_hf (its API, called here)",
            "effect": "the static engine sizes its KV cache exactly batch x (prompt + max_new_tokens), with "
            "no size option; releasing it keeps the cache (about 0.5 GiB at batch 64 x 384 tokens on this "
            "shape) out of the training step's peak, at the cost of re-recording the decode CUDA graphs "
            "at every rollout (on the CPU the engine uses model.generate and holds no cache)",
        },
    ]


def release_rollout_cache_after_each_rollout(trainer) -> bool:
    """Make the installed rollout engine drop its KV cache, buffers and graphs after every rollout."""
    patch = trainer._rapidfire.parts.get("rollout")
    if patch is None:
        return False
    generate = patch._generate

    def generate_then_release(prompt_ids):
        try:
            return generate(prompt_ids)
        finally:
            if patch._engine is not None:
                patch._engine.release()

    patch._generate = generate_then_release
    return True


def run_variant(
    variant: str,
    smoke: bool,
    steps: int,
    out: Path,
    optimizer_kwargs: dict,
    keep_rollout_cache: bool = False,
) -> dict:
    """Train one variant in this process and return its measurements."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import vowel_reward

    shape = dict(SMOKE if smoke else FULL, steps=steps)
    device = "cpu" if smoke else "cuda"
    tok = build_tokenizer(shape["vocab"])
    model = build_model(shape, tok, device)
    lowmem = variant == "rapidfire_lowmem"
    fallback = bnb_unusable(device) if lowmem else None
    extra = {}
    if lowmem:
        extra = dict(
            optim="adamw_torch" if fallback else "adamw_8bit",
            gradient_accumulation_steps=1,
            gradient_checkpointing=False,  # ours is applied below; the Trainer must not add its own
            gradient_checkpointing_kwargs={"use_reentrant": False},  # what TRL re-enables after a rollout
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
        model=model,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompts(shape["batch"] * steps, shape["prompt_len"]),
        processing_class=tok,
    )
    checkpointing = released = None
    if variant == "rapidfire":
        from rapidfire_hf import enable_rapidfire

        trainer = enable_rapidfire(trainer, optimizer_kwargs=optimizer_kwargs)
    elif lowmem:
        from rapidfire_hf import enable_rapidfire
        from rapidfire_hf.memory import apply_selective_checkpointing

        # enable_rapidfire does not apply checkpointing itself (memory.optimization only sets compaction)
        checkpointing = apply_selective_checkpointing(trainer.model, "aggressive")
        trainer = enable_rapidfire(
            trainer, config={"memory": {"optimization": "aggressive"}}, optimizer_kwargs={"rollback": "off"}
        )
        released = False if keep_rollout_cache else release_rollout_cache_after_each_rollout(trainer)
    step_times: list[float] = []
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t)

    trainer.add_callback(StepTimer())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    tokens = trainer.state.num_input_tokens_seen
    per_step_tokens = tokens / max(len(step_times), 1)
    generated = sum(h["completions/mean_length"] * shape["batch"] for h in logs)
    gib = 2.0**30
    result = {
        "variant": variant,
        "steps": len(step_times),
        "wall_s": wall,
        "step_s": step_times,
        "tokens": tokens,
        "tokens_per_sec": tokens / wall,
        "tokens_per_sec_after_first_step": per_step_tokens
        * (len(step_times) - 1)
        / max(sum(step_times[1:]), 1e-9),
        "generated_tokens_per_sec": generated / wall,
        "loss": [h["loss"] for h in logs],
        "reward": [h["reward"] for h in logs],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib if torch.cuda.is_available() else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib if torch.cuda.is_available() else None,
    }
    if variant != "stock":
        state = trainer._rapidfire
        result["installed"], result["skipped"] = state.installed, state.skipped
        result["rapidfire_metrics"] = {k: v for k, v in logs[-1].items() if k.startswith("rapidfire/")}
    if lowmem:
        from rapidfire_hf.integrations.parts import find_rapidfire_optimizer

        rf_opt = find_rapidfire_optimizer(trainer.optimizer)
        inner = rf_opt.inner
        result["lowmem"] = {
            "optim": args.optim.value if hasattr(args.optim, "value") else str(args.optim),
            "inner_optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
            "optimizer_fallback": fallback,  # None: the 8-bit optimizer ran
            "rollback": rf_opt.rollback,
            "gradient_pipeline": bool(trainer._rapidfire.pipeline),
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "checkpointing_applied": checkpointing,  # apply_selective_checkpointing's answer
            "checkpointing_on_after_training": bool(
                getattr(trainer.model, "is_gradient_checkpointing", False)
            ),
            "rollout_cache_released_after_each_rollout": released,
            "rollout": trainer._rapidfire.parts["rollout"].stats()
            if "rollout" in trainer._rapidfire.parts
            else None,
        }
    return result


def environment(smoke: bool) -> dict:
    import accelerate
    import torch
    import transformers
    import trl

    import rapidfire_hf

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "device": "cpu (smoke)" if smoke else gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "rapidfire_hf": rapidfire_hf.__version__,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    names = list(runs)
    palette = {"stock": "tab:gray", "rapidfire": "tab:red", "rapidfire_lowmem": "tab:blue"}
    colors = [palette.get(n, "tab:green") for n in names]
    tps = [runs[n]["tokens_per_sec"] for n in names]
    bars = axes[0, 0].bar(names, tps, color=colors)
    axes[0, 0].bar_label(bars, labels=[f"{v:,.0f}" for v in tps])
    axes[0, 0].set_title("tokens / s (prompt + completion)")
    mem = [runs[n]["peak_allocated_gib"] or 0.0 for n in names]
    bars = axes[0, 1].bar(names, mem, color=colors)
    if any(mem):
        axes[0, 1].bar_label(bars, labels=[f"{v:.1f}" for v in mem])
        if "stock" in runs and runs["stock"]["peak_allocated_gib"]:
            half = runs["stock"]["peak_allocated_gib"] / 2
            axes[0, 1].axhline(half, color="k", ls="--", lw=1, label="1/2 of stock")
            axes[0, 1].legend()
    axes[0, 1].set_title("peak allocated GiB" + (" (n/a on CPU)" if not any(mem) else ""))
    for ax in axes[0]:
        ax.tick_params(axis="x", labelsize=9)
    for key, ax in (("loss", axes[1, 0]), ("reward", axes[1, 1])):
        for n, c in zip(names, colors):
            ax.plot(range(1, len(runs[n][key]) + 1), runs[n][key], marker="o", label=n, color=c)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle(f"GRPO, {results['workload']} on {results['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratios_to_stock(run: dict, stock: dict) -> dict:
    return {
        "tokens_per_sec": run["tokens_per_sec"] / stock["tokens_per_sec"],
        "tokens_per_sec_after_first_step": run["tokens_per_sec_after_first_step"]
        / stock["tokens_per_sec_after_first_step"],
        "peak_allocated": (run["peak_allocated_gib"] / stock["peak_allocated_gib"])
        if stock["peak_allocated_gib"] and run["peak_allocated_gib"]
        else None,
    }


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and chart.png")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=list(VARIANTS),
        help=f"comma-separated variants to run, in order (default: {','.join(VARIANTS)})",
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
    parser.add_argument(
        "--lowmem-keep-rollout-cache",
        action="store_true",
        help="rapidfire_lowmem: keep the rollout engine's KV cache between rollouts (default: release it)",
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    steps = args.steps or shape["steps"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.variant:
        optimizer_kwargs = {"rollback": args.rollback, "snapshot": args.snapshot}
        result = run_variant(
            args.variant, args.smoke, steps, args.out, optimizer_kwargs, args.lowmem_keep_rollout_cache
        )
        (args.out / f"{args.variant}.json").write_text(json.dumps(result, indent=2))
        return
    runs = {}
    for variant in args.variants:
        cmd = [
            sys.executable,
            __file__,
            "--out",
            str(args.out),
            "--steps",
            str(steps),
            "--variant",
            variant,
            "--rollback",
            args.rollback,
            "--snapshot",
            args.snapshot,
        ]
        cmd += ["--lowmem-keep-rollout-cache"] if args.lowmem_keep_rollout_cache else []
        subprocess.run(cmd + (["--smoke"] if args.smoke else []), check=True, env=os.environ.copy())
        runs[variant] = json.loads((args.out / f"{variant}.json").read_text())
    variants = {}
    for name in runs:
        info = dict(DESCRIPTIONS[name])
        if name == "rapidfire":
            info["settings"] = [
                {
                    "setting": f'enable_rapidfire(optimizer_kwargs={{"rollback": "{args.rollback}", '
                    f'"snapshot": "{args.snapshot}"}})',
                    "source": "rapidfire_hf",
                }
            ]
        elif name == "rapidfire_lowmem":
            info["settings"] = lowmem_settings(
                runs[name]["lowmem"]["optimizer_fallback"], args.lowmem_keep_rollout_cache
            )
        variants[name] = info
    stock = runs.get("stock")
    by_variant = {n: ratios_to_stock(r, stock) for n, r in runs.items() if n != "stock"} if stock else {}
    results = {
        "command": " ".join(
            [Path(sys.executable).name, "benchmarks/grpo/run.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(args.smoke),
        "workload": (
            f"Llama hidden {shape['hidden']} x {shape['layers']} layers, {shape['prompt_len']}-token prompts, "
            f"{GENERATIONS} x {shape['completion_len']} completion tokens, batch {shape['batch']}"
        ),
        "rapidfire_optimizer": {"rollback": args.rollback, "snapshot": args.snapshot},
        "variants": variants,
        "runs": runs,
        # rapidfire / stock, as before; every variant / stock in ratios_by_variant
        "ratios": by_variant.get("rapidfire"),
        "ratios_by_variant": by_variant,
        "target": "tokens_per_sec ratio >= 3 and peak_allocated ratio <= 0.5 (vs stock)",
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "chart.png")
    print(json.dumps({"ratios_by_variant": by_variant, "out": str(args.out)}, indent=2))


if __name__ == "__main__":
    main()
