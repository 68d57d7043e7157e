"""Collect the runs of ``largest_model.sh`` into ``largest_model.json`` and draw ``largest_model.png``.

Reads from OUT_DIR: ``steps.jsonl`` (one line per run: name, exit code, seconds, or why it was skipped)
and each run's ``<name>.json`` / ``<name>.ranks/rank<r>.json`` (ppo_throughput.py, merged by its
``load_run``). One row per run: status (ok / oom / error / timeout / missing / skipped), the peak GiB of
every GPU, where a failure happened (phase, update, the allocation that failed), tokens/s when it ran.
The chart shows the peak per GPU of each run, coloured by status, against the GPU's capacity.
``comparisons``: per model, value mode and precision, which configurations train it and which run out of
memory (the SET=bf16 runs: a model that 2 GPUs train and 1 GPU does not, under the same numerics).

Usage: ``python benchmarks/distributed/largest_report.py OUT_DIR``
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ppo_throughput import load_run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import write_json  # noqa: E402

LABELS = {"zero3": "ZeRO-3", "zero2": "ZeRO-2", "fsdp2": "FSDP2", "ddp2": "DDP", "single": "1 GPU"}
COLORS = {
    "ok": "#3a7",
    "oom": "#d33",
    "error": "#888",
    "timeout": "#e90",
    "killed": "#a5c",
    "missing": "#bbb",
}


def label(name: str, processes: int | None, cpu: bool = False) -> str:
    """``zero3_separate`` -> ``ZeRO-3 x2, separate`` (``1 proc`` / ``(CPU)`` for the smoke runs)."""
    engine = LABELS.get(name.split("_")[0], name)
    if cpu and engine == "1 GPU":
        engine = "1 proc"
    elif processes and processes > 1 and engine != "1 GPU":
        engine += f" x{processes}" + (" (CPU)" if cpu else "")
    rest = name.split("_", 1)[1].replace("_", " ") if "_" in name else ""
    return f"{engine}, {rest}" if rest else engine


def _steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def run_row(out: Path, step: dict) -> dict:
    """The merged result of one run, with its step's exit code and time."""
    if step.get("skipped"):
        return {
            "name": step["name"],
            "status": "skipped",
            "why": step["skipped"],
            "label": label(step["name"], None),
        }
    row = load_run(out / f"{step['name']}.json")
    peaks = [p for p in row.get("peak_gib_per_rank", []) if p is not None]
    ranks = row.get("ranks", [])
    keep = {
        "name": step["name"],
        "label": label(step["name"], row.get("processes"), cpu=_on_cpu(row)),
        "status": row["status"],
        "rc": step.get("rc"),
        "seconds": step.get("seconds"),
        "limit": step.get("limit"),
        "engine": row.get("engine"),
        "launcher": row.get("launcher"),
        "processes": row.get("processes"),
        "model": row.get("model"),
        "value_mode": row.get("value_mode"),
        "optimizer": row.get("optimizer"),
        "precision": row.get("precision") or _precision(row),
        "param_dtypes": row.get("param_dtypes"),
        "optimizer_state_dtypes": row.get("optimizer_state_dtypes"),
        "reward": row.get("reward"),
        "rollout_batch_per_rank": row.get("rollout_batch_per_rank"),
        "prompt_length": row.get("prompt_length"),
        "response_length": row.get("response_length"),
        "trainable_params": row.get("trainable_params"),
        "peak_gib_per_rank": row.get("peak_gib_per_rank"),
        "max_peak_gib": max(peaks) if peaks else None,
        "gpu_total_gib": next((r.get("gpu_total_gib") for r in ranks if r.get("gpu_total_gib")), None),
        "resident_gib_after_prepare": [r.get("resident_gib_after_prepare") for r in ranks],
        "phase_peak_gib": [r.get("phase_peak_gib") for r in ranks],
        "tokens_per_second": row.get("tokens_per_second"),
        "seconds_per_update": row.get("seconds_per_update"),
        "updates": row.get("updates"),
        "build_seconds": row.get("build_seconds"),
        "rollout_backend": row.get("rollout_backend"),
        "versions": row.get("versions"),
    }
    if row["status"] in ("missing", "killed"):  # the launcher's own words: why no rank wrote an outcome
        log = out / f"{step['name']}.log"
        keep["log_tail"] = (
            "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else None
        )
    if row["status"] != "ok":
        keep.update(
            failed_phase=row.get("failed_phase"),
            failed_update=row.get("failed_update"),
            requested_gib=row.get("requested_gib"),
            error=(row.get("error") or "")[:600] or None,
            rank_status=[r.get("status") for r in ranks],
            traceback_tail=next((r.get("traceback") for r in ranks if r.get("traceback")), None),
        )
    return keep


def _on_cpu(row: dict) -> bool:
    if row.get("device_type"):
        return row["device_type"] == "cpu"
    return row.get("dtype") == "fp32"  # rows written before device_type existed


def _precision(row: dict) -> str | None:
    """Rows written before ``precision`` existed: bf16 weights on the GPU were bf16 mixed precision."""
    dtype = row.get("dtype")
    return {"bf16": "bf16-mixed", "fp32": "fp32"}.get(dtype) if dtype else None


def verdict(row: dict) -> str:
    """One line: what the run shows about the largest model this engine trains."""
    what = (
        f"{row.get('model')} {row.get('value_mode')} full FT ({row.get('optimizer')}, {row.get('precision')})"
    )
    status = row["status"]
    if status == "skipped":
        return f"{row['label']}: not run ({row.get('why')})"
    if status == "missing":
        return f"{row['label']}: no result (launcher exit code {row.get('rc')}; see {row['name']}.log)"
    peak = row.get("max_peak_gib")
    at = f" at {peak:.1f} GiB per GPU" if peak is not None else ""
    if status == "ok":
        tps = row.get("tokens_per_second")
        speed = f", {tps:,.0f} tokens/s" if tps else ""
        return f"{row['label']}: {what} trains{at}{speed}"
    if status == "oom":
        ask = f", asking {row['requested_gib']:.2f} GiB more" if row.get("requested_gib") else ""
        return f"{row['label']}: {what} out of memory{_where(row)}{at}{ask}"
    return f"{row['label']}: {what} {status}{_where(row)}{at}"


def _where(row: dict) -> str:
    """`` in rollout (update 2)``, `` in build``, or nothing when the phase is unknown."""
    if not row.get("failed_phase"):
        return ""
    update = row.get("failed_update")
    return f" in {row['failed_phase']}" + (f" (update {update})" if update else "")


def _engine(row: dict) -> str:
    """``FSDP2 x2`` / ``1 GPU``: the label without the run's own words."""
    return row["label"].split(",")[0]


def comparisons(rows: list[dict]) -> list[str]:
    """Per model, value mode and precision (runs that differ only in the engine): which engines train it,
    which run out of memory, in the order the runs came. One line per group that ran on more than one
    engine, e.g. ``llama-15b fused bf16: trains on FSDP2 x2 (111.0 GiB/GPU); out of memory on 1 GPU
    (train, update 1)``."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] in ("skipped", "missing"):
            continue
        groups.setdefault((row.get("model"), row.get("value_mode"), row.get("precision")), []).append(row)
    lines = []
    for (model, value_mode, precision), members in groups.items():
        if len({_engine(r) for r in members}) < 2:
            continue
        parts = []
        for r in members:
            peak = r.get("max_peak_gib")
            at = f" ({peak:.1f} GiB/GPU)" if peak is not None and r["status"] == "ok" else ""
            if r["status"] == "ok":
                parts.append(f"trains on {_engine(r)}{at}")
            else:
                what = "out of memory" if r["status"] == "oom" else r["status"]
                phase, update = r.get("failed_phase"), r.get("failed_update")
                where = f" ({phase}" + (f", update {update}" if update else "") + ")" if phase else ""
                parts.append(f"{what} on {_engine(r)}{where}")
        lines.append(f"{model} {value_mode} {precision}: " + "; ".join(parts))
    return lines


def collect(out: Path) -> dict:
    rows = [run_row(out, s) for s in _steps(out)]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": rows,
        "verdicts": [verdict(r) for r in rows],
        "comparisons": comparisons(rows),
    }


def chart(results: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart; run `python {__file__} OUT_DIR` where it is.")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["runs"] if r["status"] != "skipped"]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(1.9 * len(rows) + 2.5, 4.2))
    width = 0.38
    top = 1.0
    notes = []
    for i, row in enumerate(rows):
        peaks = row.get("peak_gib_per_rank") or [None]
        n = len(peaks)
        for j, peak in enumerate(peaks):
            x = i + (j - (n - 1) / 2) * width
            height = peak or 0.0
            ax.bar(x, height, width * 0.92, color=COLORS.get(row["status"], "#bbb"), edgecolor="k", lw=0.4)
            if n > 1 and peak is not None:
                ax.text(x, height / 2, f"GPU{j}", ha="center", va="center", fontsize=7, rotation=90)
            top = max(top, height)
        peak = row.get("max_peak_gib")
        if row["status"] == "ok":
            tps = row.get("tokens_per_second")
            note = "ok" + (f"\n{tps:,.0f} tok/s" if tps else "")
        else:
            note = row["status"].upper() + (f"\n({row['failed_phase']})" if row.get("failed_phase") else "")
        if peak is not None:
            note = f"{peak:.1f} GiB\n" + note
        notes.append((i, peak or 0.0, note))
    capacity = next((r["gpu_total_gib"] for r in rows if r.get("gpu_total_gib")), None)
    if capacity:
        ax.axhline(capacity, ls="--", c="k", lw=0.8)
        ax.text(
            len(rows) - 0.5, capacity, f"GPU memory {capacity:.0f} GiB", ha="right", va="bottom", fontsize=7
        )
        top = max(top, capacity)
    for i, height, note in notes:
        box = {"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85}
        ax.text(i, height + top * 0.02, note, ha="center", va="bottom", fontsize=8, bbox=box)
    ax.set_ylim(0, top * 1.35)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    models = {r.get("model") for r in rows}
    ticks = [
        r["label"] if len(models) == 1 else f"{r['label']}\n{r.get('model')}, {r.get('precision')}"
        for r in rows
    ]
    ax.set_xticks(range(len(rows)), ticks, fontsize=8)
    ax.set_ylabel("peak allocated per GPU (GiB)")
    first = rows[0]
    what = first.get("model") if len(models) == 1 else "model per bar"
    ax.set_title(
        f"PPO full fine-tuning, {what}, {first.get('rollout_batch_per_rank')} prompts/GPU, {first.get('prompt_length')}+{first.get('response_length')} tokens",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(out: Path) -> dict:
    results = collect(out)
    results["chart"] = "largest_model.png" if chart(results, out / "largest_model.png") else None
    write_json(out / "largest_model.json", results)
    print("\n".join(results["verdicts"] + results["comparisons"]))
    return results


if __name__ == "__main__":
    main(Path(sys.argv[1]))
