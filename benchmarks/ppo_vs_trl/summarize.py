"""One table and one chart from every stored PPO throughput run in results/ (same H200, same workload).

    python benchmarks/ppo_vs_trl/summarize.py [--results benchmarks/ppo_vs_trl/results]

Reads the row files that run.py wrote (results.json, trl_large_batches.json, ours_compiled_decode.json, fused_b256_compiled.json,
any other *.json with "rows"), keeps the throughput rows, and writes summary.csv and summary.png:
tokens/s against rollout batch per system, each row labelled with the run it came from.
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


def load_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        for row in data.get("rows", []) if isinstance(data, dict) else []:
            if row.get("part") == "throughput" and row.get("status") == "ok":
                # runs with the compiled decode step (decode_mode "auto" on GPU) are stored as *compiled*.json
                decode = "compiled decode" if "compiled" in path.stem else None
                if row["system"] == "rapidfire" and decode is None:
                    decode = "CUDA-graph decode"
                rows.append({**row, "source": path.name, "decode": decode})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")
    folder = p.parse_args().results
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
        series.setdefault(name, []).append((r["batch"], r["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in sorted(series.items()):
        pts.sort()
        style = "--" if name.startswith("stock") else "-"
        ax.plot([b for b, _ in pts], [t for _, t in pts], style, marker="o", label=name)
        for b, t in pts:
            ax.annotate(
                f"{t:,.0f}", (b, t), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center"
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollout batch (prompts per update)")
    ax.set_ylabel("tokens / s (prompt + response)")
    ax.set_title("PPO on one H200: 1.1B Llama shape, 128 + 384 tokens, 1 epoch, micro-batch 8")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "summary.png", dpi=110)
    print(f"wrote {folder / 'summary.csv'} and summary.png ({len(rows)} rows)")


if __name__ == "__main__":
    main()
