"""Collect the outputs of ``run.sh`` into ``results.json`` and draw ``tokens_per_second.png``.

Reads from OUT_DIR: ``steps.jsonl`` (one line per step of run.sh: name, exit code, seconds),
``tput_<n>.json`` (ppo_throughput.py), ``smoke_<engine>/ppo_rank<r>.pt`` (ppo_ranks.py).

``--sft ROOT`` instead summarises ``tests/distributed/scripts/sft_ranks.py`` runs (SFTTrainer with
``enable_rapidfire``), one ``ROOT/sft_<engine>`` folder each, into ``ROOT/sft_engines.json``.

Usage: ``python benchmarks/distributed/report.py OUT_DIR`` or ``report.py --sft ROOT``
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

import torch

from benchmarks.common import write_json  # noqa: E402


def smoke_result(folder: Path) -> dict:
    """Did the PPO smoke finish on every rank, with finite parameters equal across ranks?"""
    ranks = [torch.load(p, weights_only=True) for p in sorted(folder.glob("ppo_rank*.pt"))]
    if not ranks:
        return {"finished": False}
    params = [r["params"] for r in ranks if r["params"].numel()]
    logged = [h.get("gradient_sync_diff") for h in ranks[0]["history"] if "gradient_sync_diff" in h]
    return {
        "finished": len(ranks) == ranks[0]["world_size"],
        "world_size": ranks[0]["world_size"],
        "engine": ranks[0]["engine"]["engine"],
        "updates": sum(1 for h in ranks[0]["history"] if "loss/policy_avg" in h),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in params),
        # sharded engines hand the full state dict to rank 0 only: nothing to compare there
        "params_equal_across_ranks": all(torch.equal(params[0], p) for p in params[1:])
        if len(params) > 1
        else None,
        "gradient_sync_diff": logged,
        "optimizer_stats": {
            k: v for k, v in ranks[0]["optimizer_stats"].items() if isinstance(v, (int, float, dict))
        },
        "features": ranks[0]["engine"]["features"],
    }


def sft_result(folder: Path) -> dict:
    """Did SFTTrainer + enable_rapidfire train on every rank: finite losses and parameters, what the
    engine kept of rapidfire, and (on failure) where and why it broke."""
    ranks = sorted(
        (torch.load(p, weights_only=True) for p in folder.glob("sft_rank*.pt")), key=lambda r: r["rank"]
    )
    if not ranks:
        return {"status": "missing", "finished": False}
    first = ranks[0]
    failed = [r for r in ranks if r["status"] != "ok"]
    params = [r["params"] for r in ranks if r["params"].numel()]
    world = first.get("world_size") or len(ranks)
    out = {
        "status": failed[0]["status"] if failed else "ok",
        "finished": not failed and len(ranks) == world,
        "ranks_written": len(ranks),
        "world_size": first.get("world_size"),
        "engine": (first.get("engine") or {}).get("engine"),
        "losses": first.get("losses"),
        "losses_finite": first.get("losses_finite"),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in params) if params else None,
        "local_params_finite": [r.get("local_params_finite") for r in ranks],
        # sharded engines hand the full state dict to rank 0 only: nothing to compare there
        "params_equal_across_ranks": all(torch.equal(params[0], p) for p in params[1:])
        if len(params) > 1
        else None,
        "optimizer": first.get("optimizer"),
        "optimizer_stats": first.get("optimizer_stats"),
        "installed": first.get("installed"),
        "skipped": first.get("skipped"),
        "features": {k: v["status"] for k, v in ((first.get("engine") or {}).get("features") or {}).items()},
        "train_seconds": first.get("train_seconds"),
    }
    if failed:
        out.update(
            failed_phase=failed[0].get("phase"),
            error=failed[0].get("error"),
            traceback_tail=failed[0].get("traceback"),
        )
    return out


def sft_summary(root: Path) -> dict:
    """``{engine: sft_result}`` over ``root/sft_<engine>`` folders, with launcher exit codes from rc.jsonl."""
    rcs = {}
    if (root / "rc.jsonl").exists():
        for line in (root / "rc.jsonl").read_text().splitlines():
            entry = json.loads(line)
            rcs[entry["run"]] = entry["rc"]
    results = {}
    for folder in sorted(p for p in root.glob("sft_*") if p.is_dir()):
        name = folder.name.removeprefix("sft_")
        results[name] = {"rc": rcs.get(name), **sft_result(folder)}
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": results}
    write_json(root / "sft_engines.json", summary)
    print(json.dumps({k: (v["status"], v.get("engine"), v.get("failed_phase")) for k, v in results.items()}))
    return summary


def collect(out: Path) -> dict:
    steps = (
        [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        if (out / "steps.jsonl").exists()
        else []
    )
    throughput = {}
    for path in sorted(out.glob("tput_*.json")):
        data = json.loads(path.read_text())
        throughput[str(data["processes"])] = data
    if "1" in throughput and "2" in throughput:
        speedup = throughput["2"]["tokens_per_second"] / throughput["1"]["tokens_per_second"]
    else:
        speedup = None
    smoke = {
        p.name.removeprefix("smoke_"): smoke_result(p) for p in sorted(out.glob("smoke_*")) if p.is_dir()
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": steps,
        "throughput": throughput,
        "speedup_2_vs_1": speedup,
        "target_speedup": 1.8,
        "ppo_smoke": smoke,
    }


def chart(results: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart; run `python {__file__} OUT_DIR` where it is.")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tput = results["throughput"]
    if not tput:
        return False
    counts = sorted(tput, key=int)
    values = [tput[c]["tokens_per_second"] for c in counts]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(
        [f"{c} GPU" if tput[c]["device"] != "cpu" else f"{c} proc" for c in counts],
        values,
        color=["#888", "#d62"][: len(values)],
    )
    ideal = values[0] * int(counts[-1]) if len(values) > 1 else None
    if ideal:
        ax.axhline(ideal, ls="--", c="k", lw=0.8, label=f"linear ({ideal:,.0f})")
        ax.legend(loc="upper left")
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom")
    first = tput[counts[0]]
    speed = results["speedup_2_vs_1"]
    ax.set_ylabel("PPO tokens/s (prompt + response)")
    ax.set_title(
        f"rapidfire_hf PPO, {first['model']} {first['dtype']}, DDP"
        + (f": {speed:.2f}x on 2" if speed else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(out: Path) -> dict:
    results = collect(out)
    results["chart"] = "tokens_per_second.png" if chart(results, out / "tokens_per_second.png") else None
    write_json(out / "results.json", results)
    print(
        json.dumps(
            {
                "speedup_2_vs_1": results["speedup_2_vs_1"],
                "steps": {s["name"]: s["rc"] for s in results["steps"]},
                "smoke": {
                    k: (v.get("finished"), v.get("params_equal_across_ranks"))
                    for k, v in results["ppo_smoke"].items()
                },
            }
        )
    )
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--sft":
        sft_summary(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
