"""Collect PPO learning runs made at several learning rates into one sweep: per-lr result folders and a chart.

    python benchmarks/ppo_vs_trl/lr_sweep.py OUT results1.json [results2.json | DIR ...]

Each input is a ``run.py`` ``results.json`` (or a folder searched for them). Learning rows are keyed by
(configuration name, lr, seed); a repeated key keeps its first row. A row without its own ``run_command``
gets its file's command with ``--learn-lr`` set to the row's lr (every learning row records the lr it ran
with). Writes:

* ``OUT/lr<lr>/`` for every learning rate: ``results.json``, ``results.csv`` and the learning chart of
  ``run.py`` (``write_outputs``);
* ``OUT/sweep.json`` and ``OUT/sweep.csv``: per system and lr the mean of the last 5 updates' reward over
  seeds (mean, standard deviation, standard error, median, min, max, runs below 0.3 = collapsed, per seed);
* ``OUT/sweep.png``: that mean against lr per system (dots: seeds), and the seed-mean reward curve of every
  system at its best lr.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import write_json  # noqa: E402

HERE = Path(__file__).resolve().parent


def _load_run():
    """benchmarks/ppo_vs_trl/run.py (its ``write_outputs``), under a name of its own: a plain ``import run``
    would pick up any other module called ``run`` already imported."""
    spec = importlib.util.spec_from_file_location("ppo_vs_trl_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = _load_run()

COLLAPSED = 0.3  # a run whose last-5 reward ends below this has collapsed (pad collapse; see README)


def system_of(row: dict) -> str:
    return re.sub(r"_s\d+$", "", row["name"])


def lr_label(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("results.json")) if p.is_dir() else [p]
    rows: dict[tuple, dict] = {}
    envs = []
    for f in files:
        data = json.loads(f.read_text())
        if "rows" not in data:  # another benchmark's results.json in the same folder tree
            continue
        env = data["environment"]
        envs.append(env)
        for r in data["rows"]:
            if r.get("part") != "learning":
                continue
            key = (r["name"], float(r["lr"]), r["seed"])
            if key in rows:
                continue
            if not r.get("run_command"):
                cmd = env.get("command", "")
                cmd = re.sub(r"--learn-lr \S+", f"--learn-lr {r['lr']:g}", cmd)
                r = {**r, "run_command": cmd, "date": env.get("date")}
            rows[key] = r
    return list(rows.values()), envs


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((system_of(r), float(r["lr"])), []).append(r)
    out = []
    for (system, lr), rs in sorted(groups.items()):
        ok = sorted((r for r in rs if r.get("status") == "ok"), key=lambda r: r["seed"])
        vals = [r["reward_last5"] for r in ok]
        entry = {"system": system, "lr": lr, "runs": len(rs), "ok": len(ok)}
        entry["failed"] = {str(r["seed"]): r.get("status") for r in rs if r.get("status") != "ok"}
        if vals:
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            entry.update(
                mean=statistics.fmean(vals),
                sd=sd,
                se=sd / len(vals) ** 0.5,
                median=statistics.median(vals),
                min=min(vals),
                max=max(vals),
                collapsed=sum(v < COLLAPSED for v in vals),
                per_seed={str(r["seed"]): r["reward_last5"] for r in ok},
            )
        out.append(entry)
    return out


def best_lr(summary: list[dict]) -> dict[str, float]:
    best: dict[str, dict] = {}
    for e in summary:
        if "mean" in e and (e["system"] not in best or e["mean"] > best[e["system"]]["mean"]):
            best[e["system"]] = e
    return {s: e["lr"] for s, e in best.items()}


def plot(rows: list[dict], summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    systems = sorted({e["system"] for e in summary})
    for i, system in enumerate(systems):
        es = [e for e in summary if e["system"] == system and "mean" in e]
        color = f"C{i}"
        a.errorbar(
            [e["lr"] for e in es],
            [e["mean"] for e in es],
            yerr=[e["se"] for e in es],
            marker="o",
            capsize=3,
            color=color,
            label=system.removeprefix("learn_"),
        )
        for e in es:
            xs = [e["lr"] * (1 + 0.04 * (i - 1))] * len(e["per_seed"])
            a.scatter(xs, list(e["per_seed"].values()), s=9, alpha=0.35, color=color)
    a.set_xscale("log")
    a.set_xlabel("learning rate")
    a.set_ylabel("reward, mean of the last 5 updates")
    a.set_title("seed mean ± standard error (dots: seeds)")
    a.axhline(COLLAPSED, color="grey", lw=0.6, ls=":")
    a.legend(fontsize=8)
    best = best_lr(summary)
    for i, system in enumerate(systems):
        rs = [r for r in rows if system_of(r) == system and float(r["lr"]) == best.get(system)]
        rs = [r for r in rs if r.get("status") == "ok"]
        if not rs:
            continue
        n = min(len(r["rewards"]) for r in rs)
        curve = [statistics.fmean(r["rewards"][k] for r in rs) for k in range(n)]
        lo = [min(r["rewards"][k] for r in rs) for k in range(n)]
        hi = [max(r["rewards"][k] for r in rs) for k in range(n)]
        xs = range(1, n + 1)
        label = f"{system.removeprefix('learn_')} at lr {lr_label(best[system])} ({len(rs)} seeds)"
        b.plot(xs, curve, color=f"C{i}", label=label)
        b.fill_between(xs, lo, hi, color=f"C{i}", alpha=0.12)
    b.set_xlabel("update")
    b.set_ylabel("reward (seed mean; band: min..max)")
    b.set_title("each system at its best learning rate")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    out = Path(argv[0])
    rows, envs = load(argv[1:])
    if not rows:
        raise SystemExit("no learning rows in the inputs")
    out.mkdir(parents=True, exist_ok=True)
    env = {"merged_from": envs, "gpu": envs[0].get("gpu")}
    for lr in sorted({float(r["lr"]) for r in rows}):
        sub = out / f"lr{lr_label(lr)}"
        sub.mkdir(exist_ok=True)
        run.write_outputs(sub, [r for r in rows if float(r["lr"]) == lr], env)
    summary = summarize(rows)
    result = {
        "collapsed_below": COLLAPSED,
        "best_lr": best_lr(summary),
        "summary": summary,
        "gpu": env["gpu"],
    }
    write_json(out / "sweep.json", result)
    keys = ["system", "lr", "runs", "ok", "mean", "sd", "se", "median", "min", "max", "collapsed"]
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(summary)
    plot(rows, summary, out / "sweep.png")
    for e in summary:
        if "mean" in e:
            print(
                f"{e['system']:28s} lr {lr_label(e['lr']):6s} n={e['ok']:2d}/{e['runs']:2d} mean {e['mean']:.3f} "
                f"± {e['se']:.3f} (sd {e['sd']:.3f}) median {e['median']:.3f} collapsed {e['collapsed']}"
            )
    print("best lr:", {k: lr_label(v) for k, v in result["best_lr"].items()})


if __name__ == "__main__":
    main(sys.argv[1:])
