"""Stock ``trl.GRPOTrainer`` against ``enable_rapidfire(GRPOTrainer(...))``, same model, data and seed.

The workload of DESIGN.md: a random-init Llama of the 1.1B shape (hidden 2048, 22 layers, 32 heads,
4 KV heads, vocab 32000) built on the GPU in bf16, 128-token prompts, 8 generations of 256 tokens per
prompt, a rule-based reward (fraction of vowels), beta 0. Each variant runs in its own process (fresh
CUDA allocator, its own peak), for ``--steps`` optimizer steps.

Reported per variant: tokens/s (prompt + completion tokens, TRL's ``num_input_tokens_seen``, over the
wall time of training; also over steps 2.. to leave out one-time warm-up such as CUDA-graph capture),
generated tokens/s, peak allocated and reserved GiB, and the loss and reward curves.

Usage:
    python benchmarks/grpo/run.py --out benchmarks/grpo/results/h200          # GPU, < 5 minutes
    python benchmarks/grpo/run.py --out /tmp/grpo-smoke --smoke               # CPU, tiny model, < 1 minute
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

VARIANTS = ("stock", "rapidfire")
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


def run_variant(variant: str, smoke: bool, steps: int, out: Path, optimizer_kwargs: dict) -> dict:
    """Train one variant in this process and return its measurements."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import vowel_reward

    shape = dict(SMOKE if smoke else FULL, steps=steps)
    device = "cpu" if smoke else "cuda"
    tok = build_tokenizer(shape["vocab"])
    model = build_model(shape, tok, device)
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
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompts(shape["batch"] * steps, shape["prompt_len"]),
        processing_class=tok,
    )
    if variant == "rapidfire":
        from rapidfire_hf import enable_rapidfire

        trainer = enable_rapidfire(trainer, optimizer_kwargs=optimizer_kwargs)
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
    if variant == "rapidfire":
        state = trainer._rapidfire
        result["installed"], result["skipped"] = state.installed, state.skipped
        result["rapidfire_metrics"] = {k: v for k, v in logs[-1].items() if k.startswith("rapidfire/")}
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
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    names = list(runs)
    axes[0, 0].bar(names, [runs[n]["tokens_per_sec"] for n in names], color=["tab:gray", "tab:red"])
    axes[0, 0].set_title("tokens / s (prompt + completion)")
    mem = [runs[n]["peak_allocated_gib"] or 0.0 for n in names]
    axes[0, 1].bar(names, mem, color=["tab:gray", "tab:red"])
    axes[0, 1].set_title("peak allocated GiB" + (" (n/a on CPU)" if not any(mem) else ""))
    for key, ax in (("loss", axes[1, 0]), ("reward", axes[1, 1])):
        for n in names:
            ax.plot(range(1, len(runs[n][key]) + 1), runs[n][key], marker="o", label=n)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.legend()
    fig.suptitle(f"GRPO, {results['workload']} on {results['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and chart.png")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant")
    parser.add_argument(
        "--rollback", choices=("auto", "off"), default="auto", help="RapidFireOptimizer rollback"
    )
    # default host: a device snapshot of weights + Adam state adds about 3x the weights to the GPU peak
    parser.add_argument(
        "--snapshot", choices=("device", "host"), default="host", help="where rollback snapshots live"
    )
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    steps = args.steps or shape["steps"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.variant:
        optimizer_kwargs = {"rollback": args.rollback, "snapshot": args.snapshot}
        result = run_variant(args.variant, args.smoke, steps, args.out, optimizer_kwargs)
        (args.out / f"{args.variant}.json").write_text(json.dumps(result, indent=2))
        return
    runs = {}
    for variant in VARIANTS:
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
        subprocess.run(cmd + (["--smoke"] if args.smoke else []), check=True, env=os.environ.copy())
        runs[variant] = json.loads((args.out / f"{variant}.json").read_text())
    stock, rapid = runs["stock"], runs["rapidfire"]
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(args.smoke),
        "workload": (
            f"Llama hidden {shape['hidden']} x {shape['layers']} layers, {shape['prompt_len']}-token prompts, "
            f"{GENERATIONS} x {shape['completion_len']} completion tokens, batch {shape['batch']}"
        ),
        "rapidfire_optimizer": {"rollback": args.rollback, "snapshot": args.snapshot},
        "runs": runs,
        "ratios": {
            "tokens_per_sec": rapid["tokens_per_sec"] / stock["tokens_per_sec"],
            "tokens_per_sec_after_first_step": rapid["tokens_per_sec_after_first_step"]
            / stock["tokens_per_sec_after_first_step"],
            "peak_allocated": (rapid["peak_allocated_gib"] / stock["peak_allocated_gib"])
            if stock["peak_allocated_gib"]
            else None,
        },
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "chart.png")
    print(json.dumps({"ratios": results["ratios"], "out": str(args.out)}, indent=2))


if __name__ == "__main__":
    main()
