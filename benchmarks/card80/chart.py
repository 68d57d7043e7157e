"""One chart of a stored benchmarks/card80 call: seconds per phase of each row (stacked, tokens/s at the end)
and each phase's planned peak against the measured one.

    python benchmarks/card80/chart.py benchmarks/card80/results/h100_2026-12-06/full7b_trades/results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common.charts import pyplot, save_figure  # noqa: E402

PHASES = (("generation", "gen_times", "rollout"), ("scoring", "score_times", "scoring"),
          ("training", "train_times", "training"))  # fmt: skip


def chart(results: Path, out: Path | None = None) -> Path:
    """Write ``chart.png`` beside ``results`` (or at ``out``) and return its path."""
    try:
        data = json.loads(Path(results).read_text())
        rows = [r for r in data["rows"] if r.get("status") == "ok"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"{results}: not a benchmarks/card80 results.json ({type(err).__name__}: {err})") from None
    if not rows:
        raise SystemExit(f"{results}: no row ran (status ok), nothing to draw")
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 2.4 + 0.9 * len(rows)))
    names = [r["row"] for r in rows]
    start = [0.0] * len(rows)
    for (phase, key, _), color in zip(PHASES, ("#4c72b0", "#dd8452", "#55a868")):
        secs = [statistics.median(r[key][1:] or r[key]) for r in rows]
        left.barh(names, secs, left=start, color=color, label=phase)
        start = [a + b for a, b in zip(start, secs)]
    for i, r in enumerate(rows):
        left.text(start[i], i, f"  {r['tokens_per_s']:,.0f} tok/s, {r['oom_splits']} OOM splits", va="center")
    left.set_xlim(0, max(start) * 1.6)
    left.set_xlabel("seconds per update (median after the warm-up)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        planned = [r["plan"]["phase_peak_bytes"][p] / 2**30 for p, _, _ in PHASES]
        measured = [r["phase_peak_gib"][k][-1] for _, _, k in PHASES]
        xs = [j + i * width for j in range(len(PHASES))]
        right.bar(xs, measured, width * 0.9, label=f"{r['row']} measured")
        right.scatter(xs, planned, marker="_", s=300, color="black", zorder=3)
    right.scatter([], [], marker="_", s=300, color="black", label="planned")
    right.axhline(rows[0]["gpu_total_gib"], color="grey", linestyle=":", label="card")
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(PHASES))], [p for p, _, _ in PHASES])
    right.set_ylabel("peak GiB per phase")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, fontsize=7)
    env = data["environment"]
    fig.suptitle(f"{env['gpu']}, {env['date'][:10]}: {', '.join(names)}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out or Path(results).with_name("chart.png"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(chart(Path(sys.argv[1])))
