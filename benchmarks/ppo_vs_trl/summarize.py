"""One table and one chart from every stored PPO throughput run in results/h200/ (same GPU, same workload).

    python benchmarks/ppo_vs_trl/summarize.py [--results benchmarks/ppo_vs_trl/results/h200]
    python benchmarks/ppo_vs_trl/summarize.py --size7b benchmarks/ppo_vs_trl/results/h200/size7b_512tok

Reads the row files that run.py wrote (any *.json with "rows" in the folder and the results.json of every
sub-folder), keeps the throughput rows, and writes summary.csv and summary.png: tokens/s against rollout batch
per system, each row labelled with the run it came from (the chart shows the latest run of a point that was
measured more than once). Runs made at different times are drawn together: a ratio read off this chart is not
a same-run ratio (see the README's "same run" column).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

LABELS = {
    ("trl", "separate"): "stock TRL 1.12 PPO",
    ("rapidfire", "separate"): "rapidfire, separate value model",
    ("rapidfire", "fused"): "rapidfire, fused policy/value",
}


def _decode(row: dict, path: Path) -> str | None:
    if row["system"] != "rapidfire":
        return None
    mode = row.get("rollout_decode_mode")  # recorded by run.py since the speed-up variants
    if mode is not None:  # "auto" and "compile" compile the decode step
        return {"cuda_graph": "CUDA-graph decode", "eager": "eager decode"}.get(mode, "compiled decode")
    # older rows: runs with the compiled decode step (decode_mode "auto" on GPU) are stored under *compiled*/
    return "compiled decode" if "compiled" in path.parent.name + path.stem else "CUDA-graph decode"


def load_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*/results.json")):
        data = json.loads(path.read_text())
        for row in data.get("rows", []) if isinstance(data, dict) else []:
            if row.get("part") == "throughput" and row.get("status") == "ok":
                source = str(path.relative_to(folder))
                rows.append({**row, "source": source, "decode": _decode(row, path)})
    return rows


SIZE_FIELDS = ["file", "name", "system", "peft", "value_mode", "batch", "micro", "status", "tokens_per_s",
               "timed_median_s", "timed_min_s", "timed_max_s", "gen_share", "peak_gib"]  # fmt: skip


def size7b_summary(folder: Path) -> list[dict]:
    """summary.csv and size7b.png of the size7b rows stored in ``folder/*.json`` (one file per run.py call):
    tokens/s and peak memory against rollout batch per system, with the median/min/max of the timed updates
    (every update after the first)."""
    import statistics

    rows = []
    for path in sorted(folder.glob("*.json")):
        for row in json.loads(path.read_text()).get("rows", []):
            if row.get("part") != "size7b" or row.get("status") != "ok":
                continue
            timed = row["update_times"][1:]
            rows.append(
                {
                    **row,
                    "file": path.name,
                    "timed_median_s": statistics.median(timed),
                    "timed_min_s": min(timed),
                    "timed_max_s": max(timed),
                }  # fmt: skip
            )
    with open(folder / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=SIZE_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for (system, mode), label in LABELS.items():
        pts = sorted(
            (r["batch"], r["tokens_per_s"], r["peak_gib"])
            for r in rows
            if (r["system"], r["value_mode"]) == (system, mode)
        )
        if pts:
            for ax, i in ((axes[0], 1), (axes[1], 2)):
                ax.plot([p[0] for p in pts], [p[i] for p in pts], "o-", label=label)
    for ax, ylabel in zip(axes, ("tokens / s (median of the timed updates)", "peak GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rollout batch (prompts)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    shape = rows[0] if rows else {}
    fig.suptitle(f"{shape.get('shape', '')} PPO, {shape.get('prompt_len')} prompt + {shape.get('response_len')} "
                 "response tokens, one GPU")  # fmt: skip
    fig.tight_layout()
    fig.savefig(folder / "size7b.png", dpi=90)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / "h200")
    p.add_argument(
        "--size7b", type=Path, default=None, help="summarise the size7b rows of this folder instead"
    )
    parsed = p.parse_args()
    if parsed.size7b is not None:
        for row in size7b_summary(parsed.size7b):
            print({k: row.get(k) for k in SIZE_FIELDS})
        return
    folder = parsed.results
    rows = load_rows(folder)
    fields = [
        "system",
        "value_mode",
        "variant",
        "decode",
        "batch",
        "tokens_per_s",
        "s_per_update",
        "gen_share",
        "peak_gib",
        "source",
    ]
    with open(folder / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        key = ("system", "value_mode", "variant", "decode", "batch")
        for r in sorted(
            rows, key=lambda r: tuple(str(r.get(k, "base")) if k != "batch" else r[k] for k in key)
        ):
            w.writerow(r)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        name = LABELS[(r["system"], r["value_mode"])] + (f" ({r['decode']})" if r["decode"] else "")
        if r.get("variant", "base") != "base":  # run.py --ours-variants: liger, compile, m<N> (own series)
            name += f" [{r['variant']}]"
        series.setdefault(name, []).append((r["batch"], r["tokens_per_s"], r.get("date") or ""))
    for name, pts in series.items():  # one point per batch: the latest run (the CSV keeps them all)
        latest = {}
        for b, t, _date in sorted(pts, key=lambda p: p[2]):
            latest[b] = (b, t)
        series[name] = sorted(latest.values())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [1, 1.1]})
    # speed-up variants measured at one batch only: right panel only
    lines = [(n, pts) for n, pts in sorted(series.items()) if "[" not in n or len(pts) > 1]
    for i, (name, pts) in enumerate(lines):
        style = "--" if name.startswith("stock") else "-"
        ax.plot([b for b, _ in pts], [t for _, t in pts], style, marker="o", label=name, color=f"C{i % 10}")
        for b, t in pts:
            ax.annotate(
                f"{t:,.0f}", (b, t), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center"
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollout batch (prompts per update)")
    ax.set_ylabel("tokens / s (prompt + response)")
    ax.set_title("PPO on one H200: 1.1B Llama shape, 128 + 384 tokens, 1 epoch, micro-batch 8")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    # right: every configuration at the largest batch that stock TRL ran, as a multiple of stock TRL there
    trl_batches = [b for n, pts in series.items() if n.startswith("stock") for b, _ in pts]
    top = max(trl_batches or [b for pts in series.values() for b, _ in pts], default=None)
    bars = sorted(((t, name) for name, pts in series.items() for b, t in pts if b == top))
    trl = next((t for t, name in bars if name.startswith("stock")), None)
    if bars:
        ys = range(len(bars))
        colors = ["C7" if n.startswith("stock") else ("C1" if "fused" in n else "C0") for _, n in bars]
        bx.barh(list(ys), [t for t, _ in bars], color=colors)
        bx.set_yticks(list(ys), [n.replace("rapidfire, ", "") for _, n in bars], fontsize=7)
        for y, (t, _) in zip(ys, bars):
            label = f" {t:,.0f}" + (f"  ({t / trl:.2f}x)" if trl else "")
            bx.text(t, y, label, va="center", fontsize=7)
        bx.set_xlim(0, max(t for t, _ in bars) * 1.25)
        bx.set_xlabel("tokens / s")
        bx.set_title(f"rollout batch {top}: every configuration (x: stock TRL at batch {top})")
        bx.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(folder / "summary.png", dpi=110)
    print(f"wrote {folder / 'summary.csv'} and summary.png ({len(rows)} rows)")


if __name__ == "__main__":
    main()
