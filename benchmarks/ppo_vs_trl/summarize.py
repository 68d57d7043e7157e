"""One table and one chart from every stored PPO throughput run in results/h200/ (same GPU, same workload).

    python benchmarks/ppo_vs_trl/summarize.py [--results benchmarks/ppo_vs_trl/results/h200]
    python benchmarks/ppo_vs_trl/summarize.py --size7b benchmarks/ppo_vs_trl/results/h200/size7b_512tok
    python benchmarks/ppo_vs_trl/summarize.py --size7b OUT --from FOLDER [FOLDER ...]   # one table of several
    python benchmarks/ppo_vs_trl/summarize.py --same-run benchmarks/ppo_vs_trl/results/h200/table_1b
    python benchmarks/ppo_vs_trl/summarize.py --sweep OUT      # the sweep part: N trials in a row vs PPOSweep

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


def _row_files(folder: Path, part: str):
    """``(path, rows)`` of every row file run.py wrote into ``folder`` (``*.json`` and ``*/results.json``),
    with the rows of ``part`` (every status)."""
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*/results.json")):
        data = json.loads(path.read_text())
        rows = data.get("rows", []) if isinstance(data, dict) else []
        yield path, [r for r in rows if r.get("part") == part]


def _timed_seconds(row: dict) -> list[float]:
    """Seconds of a row's timed updates: every update after the first (the warm-up)."""
    return (row.get("update_times") or [])[1:]


def load_rows(folder: Path) -> list[dict]:
    rows = []
    for path, part_rows in _row_files(folder, "throughput"):
        for row in part_rows:
            if row.get("status") == "ok":
                source = str(path.relative_to(folder))
                rows.append({**row, "source": source, "decode": _decode(row, path)})
    return rows


SIZE_FIELDS = ["file", "name", "system", "peft", "value_mode", "batch", "micro", "status", "tokens_per_s",
               "timed_median_s", "timed_min_s", "timed_max_s", "gen_share", "score_s", "train_s", "peak_gib",
               "optimizer_class", "reward"]  # fmt: skip


def _size7b_rows(folder: Path) -> list[dict]:
    """The size7b rows of ``folder``: from ``*.json`` / ``*/results.json`` (every status), then the brief
    per-configuration lines run.py printed into ``log.txt`` for a configuration whose row file is not stored
    (``source`` says which; a log line has the median but not the single update times)."""
    rows, seen = [], set()
    for path, part_rows in _row_files(folder, "size7b"):
        for row in part_rows:
            rows.append({**row, "source": str(path.relative_to(folder))})
            seen.add(row["name"])
    log = folder / "log.txt"
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith('{"name": "s7_'):
            brief = json.loads(line)
            if brief["name"] not in seen:
                seen.add(brief["name"])
                rows.append({**_from_name(brief["name"]), **brief, "source": "log.txt"})
    return rows


def _from_name(name: str) -> dict:
    """system / value_mode / peft / batch of a size7b row name (s7_<trl|rapidfire|fused>_<full|lora>[_b<N>])."""
    parts = name.split("_")
    system, mode = {"trl": ("trl", "separate"), "rapidfire": ("rapidfire", "separate")}.get(
        parts[1], ("rapidfire", "fused")
    )
    batch = next((int(x[1:]) for x in parts[3:] if x.startswith("b") and x[1:].isdigit()), 8)
    return {
        "system": system,
        "value_mode": mode,
        "peft": None if parts[2] == "full" else parts[2],
        "batch": batch,
    }


def size7b_summary(folder: Path, sources: list[Path] | None = None) -> list[dict]:
    """summary.csv and size7b.png of the size7b rows stored in ``folder`` (one sub-folder or file per run.py
    call), or, with ``sources``, of the rows stored in each of those folders (one table of several entries,
    written into ``folder``): per configuration its status, tokens/s with the median/min/max of the timed
    updates (every update after the first), and peak memory; an OOM row is drawn at the memory it reached."""
    import statistics

    found = (
        [{**r, "source": f"{src.name}/{r['source']}"} for src in sources for r in _size7b_rows(src)]
        if sources
        else _size7b_rows(folder)
    )
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in found:
        timed = _timed_seconds(row)
        stats = (
            {"timed_median_s": statistics.median(timed), "timed_min_s": min(timed), "timed_max_s": max(timed)}
            if timed
            else {"timed_median_s": row.get("s_per_update")}
        )
        rows.append({**row, "file": row["source"], **stats})
    with open(folder / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=SIZE_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r):
        who = LABELS[(r["system"], r["value_mode"])].replace("rapidfire, ", "ours, ")
        return f"{who}, {r.get('peft') or 'full'}, batch {r['batch']}"

    rows.sort(key=lambda r: (r.get("peft") or "", r["system"] != "trl", r["batch"]))
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(rows) + 2.2), sharey=True)
    ys = list(range(len(rows)))
    colors = ["C7" if r["system"] == "trl" else ("C1" if r["value_mode"] == "fused" else "C0") for r in rows]
    axes[0].barh(ys, [r.get("tokens_per_s") or 0 for r in rows], color=colors)
    axes[1].barh(ys, [r.get("peak_gib") or 0 for r in rows], color=colors)
    for y, r in zip(ys, rows):
        ok = r.get("status") == "ok"
        axes[0].text(r.get("tokens_per_s") or 0, y, f" {r['tokens_per_s']:,.0f}" if ok else f" {r.get('status')}",
                     va="center", fontsize=8)  # fmt: skip
        axes[1].text(r.get("peak_gib") or 0, y, f" {r.get('peak_gib') or 0:.1f}", va="center", fontsize=8)
    axes[0].set_yticks(ys, [label(r) for r in rows], fontsize=8)
    axes[0].set_xlabel("tokens / s (median of the timed updates)")
    axes[1].set_xlabel("peak GiB (OOM rows: what they reached)")
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlim(0, ax.get_xlim()[1] * 1.2)
    shape = next((r for r in rows if r.get("shape")), {})
    reward = "a reward model of the same shape" if shape.get("reward") == "model" else "a rule reward"
    fig.suptitle(f"{shape.get('shape', '')} PPO, {shape.get('prompt_len', '')} prompt + "
                 f"{shape.get('response_len', '')} response tokens, {reward}, one GPU")  # fmt: skip
    fig.tight_layout()
    fig.savefig(folder / "size7b.png", dpi=90)
    return rows


SAME_RUN_FIELDS = ["file", "batch", "ours", "stock_tokens_per_s", "stock_min", "stock_max", "ours_tokens_per_s",
                   "ours_min", "ours_max", "ratio", "stock_peak_gib", "ours_peak_gib"]  # fmt: skip


def _tokens_per_s_range(row: dict) -> tuple[float, float, float]:
    """Median / min / max tokens/s of a throughput row over its timed updates (every update after the first)."""
    import statistics

    tokens = row["batch"] * (row["prompt_len"] + row["response_len"])
    timed = _timed_seconds(row)
    if not timed:
        return row["tokens_per_s"], row["tokens_per_s"], row["tokens_per_s"]
    return tokens / statistics.median(timed), tokens / max(timed), tokens / min(timed)


def same_run_summary(folder: Path) -> list[dict]:
    """same_run.csv and same_run.png of ``folder``: each of our throughput rows next to the stock TRL row of
    the same batch **from the same results file** (one run.py call, one after another on one GPU), with the
    median / min / max tokens/s of the timed updates and the ratio of the medians. Our rows without a stock
    row in their own file get no ratio."""
    out = []
    for path, rows in _row_files(folder, "throughput"):
        ok = [r for r in rows if r.get("status") == "ok"]
        stock = {r["batch"]: r for r in ok if r["system"] == "trl"}
        for r in ok:
            if r["system"] == "trl" and any(o["system"] != "trl" and o["batch"] == r["batch"] for o in ok):
                continue  # drawn with its pair below
            base = stock.get(r["batch"]) if r["system"] != "trl" else r
            row = {"file": str(path.relative_to(folder)), "batch": r["batch"]}
            if base is not None:
                med, lo, hi = _tokens_per_s_range(base)
                row |= {"stock_tokens_per_s": med, "stock_min": lo, "stock_max": hi,
                        "stock_peak_gib": base.get("peak_gib")}  # fmt: skip
            if r["system"] != "trl":
                med, lo, hi = _tokens_per_s_range(r)
                label = f"{r['value_mode']} value" + (
                    f" [{r['variant']}]" if r.get("variant", "base") != "base" else ""
                )
                row |= {"ours": label, "ours_tokens_per_s": med, "ours_min": lo, "ours_max": hi,
                        "ours_peak_gib": r.get("peak_gib")}  # fmt: skip
                if base is not None:
                    row["ratio"] = med / row["stock_tokens_per_s"]
            out.append(row)
    out.sort(key=lambda r: (r["batch"], r.get("ours") or "", r["file"]))
    with open(folder / "same_run.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=SAME_RUN_FIELDS)
        writer.writeheader()
        writer.writerows(out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.55 * len(out) + 2))
    for y, r in enumerate(out):
        for key, color, dy in (
            ("stock", "C7", 0.2),
            ("ours", "C1" if "fused" in (r.get("ours") or "") else "C0", -0.2),
        ):
            med = r.get(f"{key}_tokens_per_s")
            if med is None:
                continue
            err = [[med - r[f"{key}_min"]], [r[f"{key}_max"] - med]]
            ax.barh(y + dy, med, height=0.38, color=color, xerr=err, capsize=2)
        text = f" {r['ratio']:.2f}x" if r.get("ratio") else ""
        ax.text(max(r.get("ours_tokens_per_s") or 0, r.get("stock_tokens_per_s") or 0), y, text, va="center")
    ax.set_yticks(range(len(out)), [f"b{r['batch']} {r.get('ours') or 'stock only'} ({r['file'].split('/')[0]})"
                                    for r in out], fontsize=8)  # fmt: skip
    ax.set_xlabel(
        "tokens / s: median of the timed updates, whiskers min-max (grey: stock TRL 1.12, same file)"
    )
    ax.set_title("PPO, stock TRL against ours in the same run, one GPU")
    ax.grid(alpha=0.3, axis="x")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.15)
    fig.tight_layout()
    fig.savefig(folder / "same_run.png", dpi=100)
    return out


SWEEP_FIELDS = ["file", "trials", "batch", "trl_seq_s", "ours_seq_s", "sweep_s", "sweep_min_s", "sweep_max_s",
                "trl_tokens_per_s", "ours_tokens_per_s", "sweep_tokens_per_s", "vs_trl", "vs_ours",
                "trl_peak_gib", "ours_peak_gib", "sweep_peak_gib"]  # fmt: skip


def sweep_summary(folder: Path) -> list[dict]:
    """sweep.csv and sweep.png of the sweep part's rows in ``folder``: per PPOSweep row of N trials, the
    seconds one update of all N trials takes run one after another (the sum of the medians of trials
    t0..t<N-1>, stock TRL and ours, from the **same results file**) against one PPOSweep round (its
    median, min and max over the timed rounds), as tokens/s and ratios. A sequential side with a missing or
    failed trial row gets no number."""
    import statistics

    out = []
    for path, rows in _row_files(folder, "sweep"):
        ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
        for r in (r for r in rows if r["system"] == "sweep" and r.get("status") == "ok"):
            n, tokens = r["trials"], r["batch"] * (r["prompt_len"] + r["response_len"])
            timed = _timed_seconds(r) or r["update_times"]
            row = {"file": str(path.relative_to(folder)), "trials": n, "batch": r["batch"],
                   "sweep_s": statistics.median(timed), "sweep_min_s": min(timed), "sweep_max_s": max(timed),
                   "sweep_peak_gib": r.get("peak_gib")}  # fmt: skip
            row["sweep_tokens_per_s"] = n * tokens / row["sweep_s"]
            for tag in ("trl", "ours"):
                trial_rows = [ok.get(f"sw_{'rapidfire' if tag == 'ours' else tag}_t{i}") for i in range(n)]
                if all(t is not None for t in trial_rows):
                    seq = sum(t["s_per_update"] for t in trial_rows)
                    peaks = [t.get("peak_gib") for t in trial_rows if t.get("peak_gib") is not None]
                    row |= {f"{tag}_seq_s": seq, f"{tag}_tokens_per_s": n * tokens / seq,
                            f"vs_{tag}": seq / row["sweep_s"], f"{tag}_peak_gib": max(peaks, default=None)}  # fmt: skip
            out.append(row)
    out.sort(key=lambda r: (r["file"], r["trials"]))
    with open(folder / "sweep.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=SWEEP_FIELDS)
        writer.writeheader()
        writer.writerows(out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    sides = (("trl", "stock TRL 1.12, one trial after another", "C7"),
             ("ours", "rapidfire PPOTrainer, one trial after another", "C0"),
             ("sweep", "rapidfire PPOSweep, all trials at once", "C1"))  # fmt: skip
    for k, (tag, label, color) in enumerate(sides):
        xs = [i + (k - 1) * 0.27 for i in range(len(out))]
        tps = [r.get(f"{tag}_tokens_per_s") or 0 for r in out]
        ax.bar(xs, tps, width=0.27, color=color, label=label)
        bx.bar(xs, [r.get(f"{tag}_peak_gib") or 0 for r in out], width=0.27, color=color, label=label)
        for x, r in zip(xs, out):
            if tag == "sweep":
                text = "  ".join(
                    f"{v:.2f}x {w}" for w, v in (("stock", r.get("vs_trl")), ("ours", r.get("vs_ours"))) if v
                )
                ax.annotate(text, (x, r["sweep_tokens_per_s"]), ha="center", va="bottom", fontsize=7)
    labels = [f"{r['trials']} trials x {r['batch']}\n{r['file'].split('/')[0]}" for r in out]
    for a, title in ((ax, "tokens / s over all trials (median update)"), (bx, "peak GiB")):
        a.set_xticks(range(len(out)), labels, fontsize=8)
        a.set_title(title)
        a.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("LoRA PPO sweeps on one GPU: N trials one after another against PPOSweep, same run")
    fig.tight_layout()
    fig.savefig(folder / "sweep.png", dpi=100)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / "h200")
    p.add_argument(
        "--size7b", type=Path, default=None, help="summarise the size7b rows of this folder instead"
    )
    p.add_argument(
        "--from",
        dest="sources",
        type=Path,
        nargs="+",
        default=None,
        help="with --size7b OUT: one table of the size7b rows of these folders, written into OUT",
    )
    p.add_argument(
        "--same-run", type=Path, default=None, help="pair each of our rows with stock's row of its own file"
    )
    p.add_argument("--sweep", type=Path, default=None, help="summarise the sweep part's rows of this folder")
    parsed = p.parse_args()
    if parsed.sweep is not None:
        for row in sweep_summary(parsed.sweep):
            print({k: row.get(k) for k in SWEEP_FIELDS})
        return
    if parsed.same_run is not None:
        for row in same_run_summary(parsed.same_run):
            print({k: row.get(k) for k in SAME_RUN_FIELDS})
        return
    if parsed.size7b is not None:
        for row in size7b_summary(parsed.size7b, parsed.sources):
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
