"""Stock ``trl.SFTTrainer`` / ``trl.DPOTrainer`` against the same trainers through ``enable_rapidfire``.

Workload: a random-init Llama of the 1.1B shape (hidden 2048, 22 layers, 32 heads, 4 KV heads,
intermediate 5632, vocab 32000) built on the GPU in bf16, sequence length 2048, random tokens.

- SFT: pre-tokenized rows of exactly 2048 tokens (no packing needed), batch 8 per step.
- DPO: a 1024-token prompt plus 1024-token chosen and rejected completions (1023 random words + EOS),
  so each pair is two 2048-token rows; batch 4 pairs per step; reference model = an identical copy.

Systems (each trainer, each system in its own process, so that peak memory is that system's alone):

- ``stock``: TRL's defaults, which include ``gradient_checkpointing=True`` (full recompute).
- ``stock_no_ckpt``: stock with ``gradient_checkpointing=False``, the one TRL option ``rapidfire`` also
  changes: the "stock + the same TRL options" row.
- ``stock_sac`` (SFT only): TRL 1.16's own selective checkpointing,
  ``gradient_checkpointing_kwargs={"selective": True}`` (saves attention outputs, recomputes the rest).
- ``rapidfire``: ``enable_rapidfire(trainer, {"preset": "balanced", "memory": {"checkpointing":
  "elementwise"}}, optimizer_kwargs={"rollback": "off"})`` (selective checkpointing forced: saves matmul and attention
  outputs, recomputes element-wise ops), with TRL's ``gradient_checkpointing=False`` so that the Trainer
  does not put full checkpointing over it.
- ``rapidfire_aggressive`` (opt-in with ``--systems``): the ``aggressive`` preset, full checkpointing.

Measured per row: seconds per step (CUDA synchronised at both ends of every step), tokens/s after the
first (warm-up) step and over all steps, peak allocated / reserved GiB from ``torch.cuda``, and the loss
of every step (same weights, data and seed everywhere: the curves are compared against ``stock``).
``--max-batch`` also searches the largest per-device batch of each system (doubling, stop at OOM).

Usage:
    python benchmarks/trl_trainers/run.py --out benchmarks/trl_trainers/results/h200 --max-batch  # GPU, ~5 min
    python benchmarks/trl_trainers/run.py --out /tmp/trl-smoke --smoke                            # CPU, tiny model
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import environment as common_environment  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from rapidfire_hf.utils.units import GIB  # noqa: E402

TRAINERS = ("sft", "dpo")
FULL = dict(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000, seq=2048)
SMOKE = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, seq=64)
# Per-device batch (SFT rows / DPO pairs): 16,384 trained tokens per step for both trainers.
BATCH = {"sft": 8, "dpo": 4}
SMOKE_BATCH = {"sft": 2, "dpo": 2}
# Largest absolute difference of a loss curve from stock's that counts as "the same math". On the GPU the
# weights are bf16, so one rounding flip after an update moves later losses (SFT starts near ln 32000 =
# 10.4, DPO at ln 2 = 0.69); on the CPU everything is fp32.
LOSS_TOLERANCE = {"gpu_bf16": {"sft": 0.02, "dpo": 0.01}, "cpu_fp32": {"sft": 1e-4, "dpo": 1e-4}}
SEARCH_STEPS = 2  # the second step is the first with Adam state next to activations
FIRST_ROW_ESTIMATE_S = 30.0  # process time of one measurement before any has been seen
PROCESS_START = time.monotonic()


class System(NamedTuple):
    """One way of running a TRL trainer: its TRL arguments and, for ours, the rapidfire preset."""

    description: str
    trl_args: dict = {}  # noqa: RUF012 (read only)
    preset: str | None = None  # rapidfire preset for enable_rapidfire; None: stock TRL
    trainers: tuple[str, ...] = TRAINERS


SYSTEMS = {
    "stock": System("stock TRL defaults (gradient_checkpointing=True: full recompute)"),
    "stock_no_ckpt": System(
        "stock TRL, gradient_checkpointing=False (the TRL option 'rapidfire' also sets)",
        {"gradient_checkpointing": False},
    ),
    "stock_sac": System(
        "stock TRL selective checkpointing, gradient_checkpointing_kwargs={'selective': True} (SFT only)",
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"selective": True}},
        trainers=("sft",),
    ),
    "rapidfire": System(
        "enable_rapidfire('balanced') + rapidfire selective checkpointing, TRL gradient_checkpointing=False",
        {"gradient_checkpointing": False},
        preset="balanced",
    ),
    "rapidfire_aggressive": System(
        "enable_rapidfire('aggressive') + rapidfire full checkpointing, TRL gradient_checkpointing=False",
        {"gradient_checkpointing": False},
        preset="aggressive",
    ),
}
DEFAULT_SYSTEMS = ("stock", "rapidfire", "stock_no_ckpt", "stock_sac")
# memory.checkpointing each preset's row forces (what the preset's level meant before levels became targets)
FORCED_POLICY = {"balanced": "elementwise", "aggressive": "matmuls"}


# ---- model, tokenizer, data ------------------------------------------------------------------------


def build_tokenizer(vocab: int):
    """Word-level tokenizer: ``<pad> <s> </s> <unk>`` then ``w4 .. w{vocab-1}``, one token per word."""
    from tokenizers import pre_tokenizers

    from rapidfire_hf.demo.task import wordlevel_tokenizer

    words = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}
    words.update({f"w{i}": i for i in range(len(words), vocab)})
    return wordlevel_tokenizer(words, pre_tokenizers.WhitespaceSplit())


def build_model(shape: dict, device: str, seed: int = 0):
    """Random-init Llama built on ``device`` (then bf16 on the GPU): the same weights for the same seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidfire_hf.demo.shapes import config_kwargs

    config = LlamaConfig(
        **config_kwargs(shape),
        max_position_embeddings=shape["seq"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the host
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16) if device == "cuda" else model


def random_ids(rng, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def sft_dataset(rows: int, shape: dict, seed: int = 0):
    """``rows`` pre-tokenized rows of exactly ``seq`` random tokens (TRL skips its own tokenization)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict(
        {"input_ids": [random_ids(rng, shape["seq"], shape["vocab"]) for _ in range(rows)]}
    )


def dpo_dataset(rows: int, shape: dict, seed: int = 0):
    """Prompt of seq/2 words, chosen and rejected of seq/2 - 1 words (TRL appends EOS): 2 x seq tokens."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    half = shape["seq"] // 2

    def text(n: int) -> str:
        return " ".join(f"w{i}" for i in random_ids(rng, n, shape["vocab"]))

    data = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(rows):
        data["prompt"].append(text(half))
        data["chosen"].append(" " + text(half - 1))
        data["rejected"].append(" " + text(half - 1))
    return Dataset.from_dict(data)


# ---- one trainer ---------------------------------------------------------------------------------------


def build_trainer(spec: dict, batch: int, steps: int):
    """The TRL trainer of ``spec`` (trainer, system, shape, ...), wrapped by ``enable_rapidfire`` for ours.

    Returns:
        ``(trainer, tokens_per_step, notes)``; tokens are counted in the prepared dataset (DPO: both rows).
    """
    system = SYSTEMS[spec["system"]]
    shape, device = spec["shape"], spec["device"]
    notes = {}
    if system.preset is not None:
        from rapidfire_hf.memory import setup_allocator

        # expandable segments before CUDA initialises, as rapidfire_hf.memory recommends
        notes["allocator_setup"] = setup_allocator()
    tok = build_tokenizer(shape["vocab"])
    model = build_model(shape, device)
    # every system must start from the same weights for the loss comparison to mean anything
    notes["weights_checksum"] = float(sum(p.double().sum() for p in model.parameters()))
    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"trl-{spec['trainer']}-{spec['system']}-"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        max_length=shape["seq"],
        learning_rate=spec["lr"],
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        use_liger_kernel=spec["liger"],
        **system.trl_args,
    )
    rows = batch * steps
    if spec["trainer"] == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common),
            train_dataset=sft_dataset(rows, shape),
            processing_class=tok,
        )
        tokens = len(trainer.train_dataset[0]["input_ids"])
    else:
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(
            model=model,
            ref_model=build_model(shape, device),  # same seed: an identical copy, as TRL would load
            args=DPOConfig(**common),
            train_dataset=dpo_dataset(rows, shape),
            processing_class=tok,
        )
        ex = trainer.train_dataset[0]
        tokens = 2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"])
    if system.preset is not None:
        from rapidfire_hf import enable_rapidfire

        # the stored rows ran with the preset's recompute policy applied by hand; since levels became
        # targets (no recompute that fits), the row forces that policy to stay the same measurement
        config = {"preset": system.preset, "memory": {"checkpointing": FORCED_POLICY[system.preset]}}
        trainer = enable_rapidfire(trainer, config, optimizer_kwargs=spec["optimizer_kwargs"])
    return trainer, tokens * batch, notes


def train_and_measure(trainer, tokens_per_step: int) -> dict:
    """Train, timing each optimizer step between CUDA synchronisations; OOM becomes a status."""
    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    step_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - self.t)

    trainer.add_callback(StepTimer())
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    status, start = "ok", time.perf_counter()
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        status = "OOM"
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    after = step_s[1:] if status == "ok" else []
    return {
        "status": status,
        "steps": len(step_s),
        "step_s": step_s,
        "wall_s": wall,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * len(after) / sum(after) if after else None,
        "tokens_per_s_all_steps": tokens_per_step * len(step_s) / wall if after else None,
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h.get("grad_norm") for h in logs],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
        "last_log": logs[-1] if logs else {},
    }


def describe(trainer) -> dict:
    """What actually ran: checkpointing on the model, rapidfire parts and optimizer statistics."""
    from rapidfire_hf.integrations.parts import find_rapidfire_optimizer, rapidfire_state

    model = trainer.accelerator.unwrap_model(trainer.model)
    ckpt = getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", None))
    info = {"checkpointing_on": bool(ckpt), "attn_implementation": model.config._attn_implementation}
    state = rapidfire_state(trainer)
    if state is not None:
        info["installed"], info["skipped"] = state.installed, state.skipped
        opt = find_rapidfire_optimizer(trainer.optimizer)
        if opt is not None:
            info["optimizer_stats"] = {k: v for k, v in opt.stats().items() if not isinstance(v, dict)}
    return info


def run_once(spec: dict, batch: int, steps: int, details: bool = False) -> dict:
    """Build, train and measure one trainer; everything it built is unreachable once this returns."""
    import torch

    try:
        trainer, tokens_per_step, notes = build_trainer(spec, batch, steps)
    except torch.OutOfMemoryError:
        return {"status": "OOM", "where": "building the trainer"}
    row = {**train_and_measure(trainer, tokens_per_step), **notes}
    if details:
        row.update(describe(trainer))
        row["rapidfire_metrics"] = {k: v for k, v in row["last_log"].items() if k.startswith("rapidfire/")}
    del row["last_log"]
    trainer.accelerator.free_memory()  # drops accelerate's references to model, optimizer and data
    shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # nothing saved; rapidfire telemetry only
    return row


def free_cached() -> None:
    import torch

    gc.collect()  # the model and optimizer reference each other through the pipeline's gradient hooks
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def child_measure(spec: dict, out: Path) -> dict:
    """Measure at ``spec['batch']``, then (when ``spec['search_until']`` is set) search the largest batch.

    The result file is rewritten after the measurement and before each search try, so a process killed
    by its timeout still leaves what it found.
    """
    import torch

    if spec["device"] == "cpu":
        torch.set_num_threads(1)  # the smoke run checks the script; one thread keeps 2-core CI timings sane
    result = {"seq": spec["shape"]["seq"], **run_once(spec, spec["batch"], spec["steps"], details=True)}
    result["device_name"] = torch.cuda.get_device_name(0) if spec["device"] == "cuda" else "cpu"
    result["measured_after_s"] = time.monotonic() - PROCESS_START  # process start to measurement done
    out.write_text(json.dumps(result, indent=2))
    if spec.get("search_until"):
        free_cached()
        search_batch(spec, result["status"] == "ok", result, out)
    return result


def search_candidates(batch: int, fits: bool, cap: int):
    """Doubling from ``2 * batch`` up to ``cap`` when ``batch`` fits, else from 1 up to below ``batch``."""
    b, stop = (batch * 2, cap) if fits else (1, batch - 1)
    while b <= stop:
        yield b
        b *= 2


def search_batch(spec: dict, fits: bool, result: dict, out: Path) -> None:
    """``result['search']``: the largest batch that trains ``SEARCH_STEPS`` steps, the first that OOMs."""
    found = {"largest_ok": spec["batch"] if fits else None, "first_oom": None if fits else spec["batch"]}
    found.update(cap=spec["search_cap"], tries=[], complete=False, trying=None)
    result["search"] = found
    last_s = 0.0
    for batch in search_candidates(spec["batch"], fits, spec["search_cap"]):
        if time.time() + 2 * last_s > spec["search_until"]:  # twice the batch: about twice the time
            found["stopped"] = "time budget"
            return
        found["trying"] = batch
        out.write_text(json.dumps(result, indent=2))
        start = time.perf_counter()
        row = run_once(spec, batch, SEARCH_STEPS)
        free_cached()
        last_s = time.perf_counter() - start
        found["tries"].append(
            {"batch": batch, "status": row["status"], "peak_gib": row.get("peak_allocated_gib"), "s": last_s}
        )
        if row["status"] != "ok":
            found["first_oom"] = batch
            break
        found["largest_ok"] = batch
    found["complete"], found["trying"] = True, None


# ---- the parent: one process per configuration ----------------------------------------------------------


def run_child(spec: dict, timeout: float, log: Path) -> dict:
    """Run one configuration in a fresh process; a timeout, crash or OOM becomes a recorded status."""
    out = log.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        json.dumps(spec),
        "--child-out",
        str(out),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group
            proc.wait()
            rc = None
    result = json.loads(out.read_text()) if out.exists() else {}
    result["process_s"] = time.perf_counter() - start
    tail = log.read_text(errors="replace")[-1500:]
    oom = "OutOfMemoryError" in tail or "out of memory" in tail
    search = result.get("search")
    if search is not None and search.get("trying") is not None:  # the measurement is done: a search try died
        if rc is None:
            search["stopped"] = f"timeout after {timeout:.0f} s"
        elif oom:
            search["stopped"], search["first_oom"] = "OOM (process crashed)", search["trying"]
        else:
            search["stopped"], search["log_tail"] = f"failed (exit {rc})", tail
    elif rc is None:
        result.setdefault("status", f"timeout after {timeout:.0f} s")
    elif rc != 0:
        result["status"] = "OOM" if oom else f"failed (exit {rc})"
        result["log_tail"] = tail
    return result


def spec_for(args, trainer: str, system: str, shape: dict) -> dict:
    rows_per_example = 1 if trainer == "sft" else 2
    return {
        "trainer": trainer,
        "system": system,
        "shape": shape,
        "device": "cpu" if args.smoke else "cuda",
        "lr": args.lr,
        "liger": args.liger,
        "optimizer_kwargs": {"rollback": args.rollback, "snapshot": args.snapshot},
        "steps": args.steps,
        "batch": args.batch[trainer],
        "search_cap": max(1, args.search_cap_rows // rows_per_example),
    }


def compare_losses(rows: list[dict], tolerance: dict) -> list[dict]:
    """Max abs difference of each system's loss curve against ``stock`` on the same trainer."""
    out = []
    for row in rows:
        ref = next((r for r in rows if r["trainer"] == row["trainer"] and r["system"] == "stock"), None)
        if ref is None or row is ref or row["status"] != "ok" or ref["status"] != "ok":
            continue
        a, b = ref["loss"], row["loss"]
        if not a or len(a) != len(b):
            continue
        diffs = [abs(x - y) for x, y in zip(a, b)]
        row["loss_max_abs_diff_vs_stock"] = max(diffs)
        out.append(
            {
                "trainer": row["trainer"],
                "system": row["system"],
                "first_step_abs_diff": diffs[0],
                "max_abs_diff": max(diffs),
                "tolerance": tolerance[row["trainer"]],
                "within_tolerance": max(diffs) <= tolerance[row["trainer"]],
            }
        )
    return out


def environment(args, rows: list[dict]) -> dict:
    """``benchmarks.common.environment`` with the GPU the child processes reported (this process has not
    touched CUDA) and the device label of the chart."""
    names = [r["device_name"] for r in rows if r.get("device_name")]
    env = common_environment()
    env["gpu"] = None if args.smoke else (names[0] if names else None)
    env["device"] = "cpu (smoke)" if args.smoke else (names[0] if names else "cuda")
    return env


CSV_FIELDS = (
    "trainer",
    "system",
    "ours",
    "status",
    "batch",
    "tokens_per_step",
    "steps",
    "step_s_median",
    "tokens_per_s",
    "tokens_per_s_all_steps",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "loss_first",
    "loss_last",
    "loss_max_abs_diff_vs_stock",
    "max_batch",
    "first_oom_batch",
    "checkpointing_on",
    "description",
)


def max_batch_text(row: dict) -> str:
    """``"16"`` when the next doubling ran out of memory, ``">=64"`` when the search stopped before one."""
    found = row.get("search") or {}
    if found.get("largest_ok") is None:
        return "-"
    return f"{found['largest_ok']}" if found.get("first_oom") else f">={found['largest_ok']}"


def status_text(row: dict) -> str:
    return f"OOM at batch {row['batch']}" if row["status"] == "OOM" else row["status"]


def csv_row(row: dict) -> dict:
    steps = sorted(row.get("step_s") or [])
    loss = row.get("loss") or []
    return {
        **{k: row.get(k) for k in CSV_FIELDS},
        "ours": SYSTEMS[row["system"]].preset is not None,
        "status": status_text(row),
        "step_s_median": steps[len(steps) // 2] if steps else None,
        "loss_first": loss[0] if loss else None,
        "loss_last": loss[-1] if loss else None,
        "max_batch": max_batch_text(row) if row.get("search") else None,
        "first_oom_batch": (row.get("search") or {}).get("first_oom"),
    }


def plot(results: dict, path: Path) -> None:
    """Tokens/s, peak memory (with the largest batch found) and loss curves, SFT left and DPO right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    on_cpu = results["environment"]["gpu"] is None
    for col, trainer in enumerate(TRAINERS):
        rows = [r for r in results["rows"] if r["trainer"] == trainer]
        names = [r["system"] for r in rows]
        colors = ["tab:red" if SYSTEMS[n].preset else "tab:gray" for n in names]
        memory_title = "peak allocated GiB (outline: reserved)" + (" - n/a on CPU" if on_cpu else "")
        for ax, key, title in (
            (axes[0, col], "tokens_per_s", "tokens/s after the warm-up step"),
            (axes[1, col], "peak_allocated_gib", memory_title),
        ):
            bars = ax.bar(names, [r.get(key) or 0.0 for r in rows], color=colors)
            if key == "peak_allocated_gib":
                ax.bar(names, [r.get("peak_reserved_gib") or 0.0 for r in rows], fill=False, edgecolor="k")
            for bar, r in zip(bars, rows):
                label = f"{bar.get_height():,.1f}" if r["status"] == "ok" else status_text(r)
                if key == "peak_allocated_gib" and r.get("search"):
                    label += f"\nmax batch {max_batch_text(r)}"
                xy = (bar.get_x() + bar.get_width() / 2, bar.get_height())
                ax.annotate(label, xy, ha="center", va="bottom", fontsize=9)
            ax.set_title(f"{trainer.upper()}: {title}")
            ax.tick_params(axis="x", labelrotation=15)
            ax.margins(y=0.15)
        for r in rows:
            if r.get("loss"):
                style = "-" if SYSTEMS[r["system"]].preset else "--"
                axes[2, col].plot(
                    range(1, len(r["loss"]) + 1), r["loss"], style, marker="o", label=r["system"]
                )
        axes[2, col].set_title(f"{trainer.upper()}: loss per step (same weights, data and seed)")
        axes[2, col].set_xlabel("optimizer step")
        axes[2, col].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(
        f"TRL trainers, seq {s['shape']['seq']}, SFT batch {s['batch']['sft']}, DPO batch {s['batch']['dpo']} "
        f"pairs, on {results['environment']['device']} (red: rapidfire)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: dict) -> str:
    head = ("trainer", "system", "status", "tokens/s", "peak GiB", "max batch", "loss diff")
    lines = [f"{head[0]:7} {head[1]:21} {head[2]:18} " + " ".join(f"{h:>10}" for h in head[3:])]
    for r in results["rows"]:
        tps, peak, diff = (
            r.get("tokens_per_s"),
            r.get("peak_allocated_gib"),
            r.get("loss_max_abs_diff_vs_stock"),
        )
        cells = (
            f"{tps:,.0f}" if tps else "-",
            f"{peak:.1f}" if peak else "-",
            max_batch_text(r),
            f"{diff:.2e}" if diff is not None else "-",
        )
        lines.append(
            f"{r['trainer']:7} {r['system']:21} {status_text(r)[:18]:18} "
            + " ".join(f"{c:>10}" for c in cells)
        )
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for results.json, results.csv, chart.png and logs/")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, seq 64, 2 steps")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="comma list of sft, dpo")
    p.add_argument("--steps", type=int, help="optimizer steps per run, the first one is warm-up (default 8)")
    p.add_argument("--batch-sft", type=int, help="SFT rows per step (default 8)")
    p.add_argument("--batch-dpo", type=int, help="DPO pairs per step (default 4)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--liger", action="store_true", help="TRL's use_liger_kernel=True on EVERY system (stock option)"
    )
    p.add_argument("--rollback", choices=("auto", "off"), default="off", help="RapidFireOptimizer rollback")
    p.add_argument("--snapshot", choices=("device", "host"), default="host", help="rollback snapshot place")
    p.add_argument("--max-batch", action="store_true", help="also search each system's largest batch")
    p.add_argument("--search-systems", default="stock,rapidfire", help="systems the batch search covers")
    p.add_argument(
        "--search-cap-rows",
        type=int,
        default=64,
        help="largest batch the search tries, in 2048-token rows (DPO: pairs x 2)",
    )
    p.add_argument("--timeout-s", type=float, help="limit per process (default 150 GPU, 600 smoke)")
    p.add_argument("--budget-s", type=float, help="whole-run limit; later configurations are skipped")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None and args.out is None:
        p.error("--out is required")
    args.steps = args.steps or (2 if args.smoke else 8)
    base = SMOKE_BATCH if args.smoke else BATCH
    args.batch = {"sft": args.batch_sft or base["sft"], "dpo": args.batch_dpo or base["dpo"]}
    args.timeout_s = args.timeout_s or (600.0 if args.smoke else 150.0)
    args.budget_s = args.budget_s or (1800.0 if args.smoke else 300.0)
    for name in args.systems.split(",") + args.search_systems.split(","):
        if name not in SYSTEMS:
            p.error(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    script = sys.argv[0] if argv is None else "benchmarks/trl_trainers/run.py"
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        result = child_measure(spec, args.child_out)
        args.child_out.write_text(json.dumps(result, indent=2))
        return None
    if args.liger:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            sys.exit("--liger needs liger-kernel installed (pip install liger-kernel)")
    shape = SMOKE if args.smoke else FULL
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    systems = args.systems.split(",")
    plan = [(t, s) for t in args.trainers.split(",") for s in systems if t in SYSTEMS[s].trainers]
    searched = [args.max_batch and s in args.search_systems.split(",") for _, s in plan]
    rows, per_row = [], []
    for i, (trainer, system) in enumerate(plan):
        spec = spec_for(args, trainer, system, shape)
        row = run_config(args, spec, deadline, len(plan) - i - 1, sum(searched[i:]), per_row)
        if row.get("measured_after_s"):
            per_row.append(row["measured_after_s"])
        rows.append(row)
    tolerance = LOSS_TOLERANCE["cpu_fp32" if args.smoke else "gpu_bf16"]
    results = {
        "command": " ".join([Path(sys.executable).name, script, *map(shlex.quote, argv)]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(args, rows),
        "settings": settings(args, shape),
        "loss_comparison": compare_losses(rows, tolerance),
        "rows": rows,
    }
    write_json(args.out / "results.json", results)
    with (args.out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(csv_row(r) for r in rows)
    plot(results, args.out / "chart.png")
    print(summary(results))
    print(f"results in {args.out}")
    return results


def run_config(args, spec: dict, deadline: float, rows_after: int, searches_left: int, per_row: list[float]):
    """One process: measure, then search the batch when asked and the time budget allows.

    The budget first covers the measurement of this row and of the ``rows_after`` still to run (the
    mean process time so far, ``FIRST_ROW_ESTIMATE_S`` before any); what is left is shared equally by
    the ``searches_left`` searches, this one included.
    """
    base = {"trainer": spec["trainer"], "system": spec["system"], "batch": spec["batch"]}
    base["description"] = SYSTEMS[spec["system"]].description
    left = deadline - time.monotonic()
    if left < 20:
        return {**base, "status": "skipped (time budget)"}
    timeout = min(args.timeout_s, left)
    search = args.max_batch and spec["system"] in args.search_systems.split(",")
    if search:
        estimate = sum(per_row) / len(per_row) if per_row else FIRST_ROW_ESTIMATE_S
        window = (left - (rows_after + 1) * estimate) / searches_left
        if window > 15:
            spec["search_until"] = time.time() + estimate + window
            timeout = min(left, args.timeout_s + window)
    print(f"running {spec['trainer']} / {spec['system']} (batch {spec['batch']})", flush=True)
    result = {
        **base,
        **run_child(spec, timeout, args.out / "logs" / f"{spec['trainer']}_{spec['system']}.log"),
    }
    if search and "search" not in result:
        result["search"] = {
            "stopped": "time budget",
            "largest_ok": spec["batch"] if result["status"] == "ok" else None,
        }
    return result


def settings(args, shape: dict) -> dict:
    from rapidfire_hf.config import load_config

    return {
        "shape": shape,
        "dtype": "float32 (CPU)" if args.smoke else "bfloat16 weights, TRL bf16=True",
        "batch": args.batch,
        "steps": args.steps,
        "learning_rate": args.lr,
        "seed": 0,
        "sft_data": f"pre-tokenized rows of {shape['seq']} random tokens, no packing",
        "dpo_data": f"prompt {shape['seq'] // 2} + chosen/rejected {shape['seq'] // 2} tokens (EOS included)",
        "tokens_per_s": "trained tokens per step (DPO: chosen + rejected rows) over the synchronised step time, "
        "steps 2..N; the DPO reference forward is extra work not counted as tokens",
        "peak_memory": "torch.cuda.max_memory_allocated/_reserved, reset after the trainer is built",
        "liger_on_every_system": args.liger,
        "rapidfire_optimizer_kwargs": {"rollback": args.rollback, "snapshot": args.snapshot},
        "systems": {name: s._asdict() for name, s in SYSTEMS.items() if name in args.systems.split(",")},
        "rapidfire_configs": {
            s.preset: load_config(s.preset).to_dict()
            for name, s in SYSTEMS.items()
            if s.preset and name in args.systems.split(",")
        },
        "loss_tolerance": LOSS_TOLERANCE["cpu_fp32" if args.smoke else "gpu_bf16"],
        "timeout_s": args.timeout_s,
        "budget_s": args.budget_s,
        "max_batch_search": {
            "systems": args.search_systems,
            "cap_rows": args.search_cap_rows,
            "steps": SEARCH_STEPS,
        }
        if args.max_batch
        else None,
    }


if __name__ == "__main__":
    main()
