"""A sweep of LoRA PPO trials: how soon the best trial is known with PPOSweep and successive halving, against
the same trials run one after another with our PPOTrainer and with stock TRL 1.12, in one call.

    python benchmarks/sweep/run.py --out OUT                 # the 1.1B shape (GPU); bash h200.sh on the H200
    python benchmarks/sweep/run.py --out /tmp/sweep --smoke  # tiny shape on the CPU, about 30 s

The trials: a grid of kl_coef x learning_rate (``--kl``, ``--lr``; default 2 x 4 = 8 trials, trial i with
seed i), LoRA r=16 on q/k/v/o, fused value heads, the ppo_vs_trl suite's models, prompts, rule reward and
shared PPO settings, ``--batch`` prompts per trial and update, ``--updates`` U updates. Four parts, each in
its own interpreter with its own timeout (``--parts``, in that order):

* ``sweep_halving``: one PPOSweep with ``SuccessiveHalving(rungs, keep)``: per update its wall time, the
  trials alive, each trial's reward; the peak GPU memory; the time at which the best trial's final reward
  is known (the round in which the winner, the best survivor by its reward at update U, finished update U);
* ``sequential_ours``: each trial with its own PPOTrainer, one after another in one process
  (``--seq-updates`` updates each; fewer than U are extrapolated per trial and labelled so);
* ``trl``: stock TRL 1.12 PPO (``TRL112_PATH``, its own interpreter, ppo_vs_trl's worker) for the first
  trial's settings, ``--trl-updates`` updates, extrapolated to every trial x U (labelled);
* ``sweep_all``: PPOSweep without halving (``--all-updates`` updates): the steady seconds per update of
  every trial together, and its peak memory.

Times run from the start of ``train()`` (the first update's compilation and CUDA-graph capture included);
``*_with_load_s`` adds the model build and the trainer's construction. Writes into ``--out`` after every
part: results.json (environment and command, each part's record, the summary against the issue's targets),
results.csv (one row per part) and sweep.png (reward against wall time of the halving run; time to the
best trial per part).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, save_figure, write_csv, write_json  # noqa: E402
from benchmarks.common.charts import pyplot  # noqa: E402
from benchmarks.ppo_vs_trl.run import LORA, SHAPES  # noqa: E402
from benchmarks.ppo_vs_trl.run import run_one as run_ppo_vs_trl_row  # noqa: E402

HERE = Path(__file__).resolve().parent
PARTS = ("sweep_halving", "sequential_ours", "trl", "sweep_all")
# the targets (issue 29): time to the best trial, steady throughput, peak memory
TARGETS = {"time_to_best_speedup": 5.0, "steady_throughput_ratio": 2.5, "peak_memory_ratio": 1.5}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def trial_grid(kls: list[float], lrs: list[float]) -> dict[str, dict]:
    """``{name: overrides}`` of the kl_coef x learning_rate grid; trial i gets seed i."""
    grid = [(kl, lr) for kl in kls for lr in lrs]
    return {
        f"kl{kl:g}-lr{lr:g}": {"kl_coef": kl, "learning_rate": lr, "seed": i}
        for i, (kl, lr) in enumerate(grid)
    }


def trl_available(path: str | None) -> str | None:
    """None when ``path`` holds trl 1.12 (stock PPO's last release), else why the stock part is skipped."""
    if not path:
        return "TRL112_PATH is not set (the folder holding trl==1.12.0, never beside trl 1.16)"
    found = sorted(Path(path).glob("trl-*.dist-info"))
    if not any(d.name.startswith("trl-1.12") for d in found):
        return f"TRL112_PATH={path} holds no trl 1.12 ({', '.join(d.name for d in found) or 'no trl'})"
    return None


# ------------------------------------------------------------------------------------------- the parts
def base_config(args) -> dict:
    """What every part shares: the shape, lengths, batch and LoRA of ppo_vs_trl's worker (part "sweep")."""
    return {
        "part": "sweep",
        "shape": args.shape,
        "shape_kwargs": SHAPES[args.shape],
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "batch": args.batch,
        "micro": min(args.micro, args.batch),
        "value_mode": "fused",
        "peft": "lora",
        "lora": LORA,
        "reward": "rule",
        # the static engine (PPOSweep's batched decode) for PPOTrainer too: "auto" picks it on a GPU but
        # model.generate on the CPU, where the smoke test compares each trial with its sweep twin
        "rollout_backend": "static",
        "decode_mode": args.decode_mode,
        "decode_routing": args.decode_routing,
        "train_rows_per_forward": args.train_rows,
        "sweep_plan": args.sweep_plan,
    }


def part_config(part: str, args) -> dict:
    cfg = {**base_config(args), "name": part, "trials": trial_grid(args.kl, args.lr)}
    if part == "sweep_halving":
        cfg.update(mode="sweep", updates=args.updates, halving={"rungs": args.rungs, "keep": args.keep})
    elif part == "sweep_all":
        cfg.update(mode="sweep", updates=args.all_updates)
    elif part == "sequential_ours":
        cfg.update(mode="sequential", updates=args.seq_updates)
    else:  # stock TRL: the first trial's settings through ppo_vs_trl's worker
        first = next(iter(cfg.pop("trials").items()))
        cfg.update(system="trl", value_mode="separate", updates=args.trl_updates, trial=first[0], **first[1])
        cfg["lr"] = cfg.pop("learning_rate")
    return cfg


def run_part(cfg: dict, timeout: float) -> dict:
    """Run one of our parts in a fresh interpreter; on a timeout or a crash, what it wrote so far stays."""
    fd, name = tempfile.mkstemp(prefix=f"sweep_bench_{cfg['name']}_", suffix=".json")
    os.close(fd)
    result = Path(name)
    result.unlink()
    cmd = [sys.executable, str(HERE / "worker.py"), json.dumps(cfg), str(result)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        status, tail = None, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as err:
        status, tail = "timeout", f"over {timeout:.0f} s: " + str(err.stderr or "")[-1000:]
    data = json.loads(result.read_text()) if result.is_file() else {}
    result.unlink(missing_ok=True)
    data.setdefault("status", "error")
    if status == "timeout":
        data["status"] = "timeout"
    if data["status"] != "ok":
        data["error"] = data.get("error") or tail
    data.update(part=cfg["name"], timeout_s=timeout, process_s=time.perf_counter() - t0)
    data["config"] = {k: v for k, v in cfg.items() if k != "shape_kwargs"}
    return data


def run_trl(cfg: dict, timeout: float) -> dict:
    why = trl_available(os.environ.get("TRL112_PATH"))
    if why:
        return {"part": "trl", "status": "skipped", "error": why}
    row = run_ppo_vs_trl_row(dict(cfg), Path(tempfile.gettempdir()), int(timeout))
    row.pop("shape_kwargs", None)
    return {**row, "part": "trl", "timeout_s": timeout}


# ------------------------------------------------------------------------------------------- derived
def _median_after_first(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values[1:] or values) if values else None


def rounds(part: dict) -> list[dict]:
    """A sweep's updates: for update k, when it ended (seconds from train()) and which trials made it."""
    by_step: dict[int, dict] = {}
    for name, t in (part.get("trials") or {}).items():
        for step, when in zip(t["steps"], t["t"]):
            r = by_step.setdefault(step, {"update": step, "t": when, "alive": []})
            r["t"] = max(r["t"], when)
            r["alive"].append(name)
    out = [by_step[k] for k in sorted(by_step)]
    for prev, r in zip([None, *out], out):
        r["s"] = r["t"] - (prev["t"] if prev else 0.0)
        r["alive_count"] = len(r["alive"])
    return out


def final_rewards(part: dict, updates: int) -> dict[str, float]:
    """Each trial's reward at update ``updates`` (trials that got there)."""
    out = {}
    for name, t in (part.get("trials") or {}).items():
        if updates in t["steps"]:
            out[name] = t["rewards"][t["steps"].index(updates)]
    return out


def best(rewards: dict[str, float]) -> str | None:
    finite = {n: r for n, r in rewards.items() if r is not None and r == r}
    return max(finite, key=finite.get) if finite else None


def sweep_summary(part: dict, updates: int) -> dict | None:
    """Time to the best trial of a sweep part, the steady s/update of its full rounds, its peak."""
    if not part.get("trials"):
        return None
    rs = rounds(part)
    n = len(part["trials"])
    full = [r["s"] for r in rs if r["alive_count"] == n]
    finals = final_rewards(part, updates)
    winner = best(finals)
    out = {"status": part.get("status"), "rounds": len(rs), "peak_gib": part.get("peak_gib"), "winner": winner,
           "final_rewards": finals, "first_update_s": rs[0]["s"] if rs else None,
           "steady_s_all_trials": _median_after_first(full), "alive_per_update": [r["alive_count"] for r in rs]}  # fmt: skip
    load = (part.get("build_s") or 0.0) + (part.get("init_s") or 0.0)
    if winner is not None:
        t = part["trials"][winner]["t"][part["trials"][winner]["steps"].index(updates)]
        out.update(time_to_best_s=t, time_to_best_with_load_s=t + load, how="measured")
    elif rs and out["steady_s_all_trials"] and rs[-1]["alive_count"] == n:  # cut short: every trial still on
        t = rs[0]["s"] + out["steady_s_all_trials"] * (updates - 1)
        out.update(time_to_best_s=t, time_to_best_with_load_s=t + load,
                   how=f"extrapolated: first update + median of {len(full) - 1} later updates x {updates - 1}")  # fmt: skip
    return out


def sequential_summary(part: dict, updates: int) -> dict | None:
    """Our trials one after another: each trial's train() time (measured when it ran ``updates`` updates,
    else its first update + the median of its later ones x (U - 1)); trials that did not run (timeout)
    are counted at the median of those that did, and the record says how many."""
    trials = {n: t for n, t in (part.get("trials") or {}).items() if t.get("status") == "finished"}
    total = len((part.get("config") or {}).get("trials") or part.get("trials") or {})
    if not trials:
        return None
    per, how = {}, set()
    for name, t in trials.items():
        if t["steps"] and t["steps"][-1] >= updates:
            per[name] = t["t"][t["steps"].index(updates)]
            how.add("measured")
        else:
            first, later = t["t"][0], [b - a for a, b in zip(t["t"], t["t"][1:])]
            per[name] = first + (statistics.median(later) if later else first) * (updates - 1)
            how.add(
                f"extrapolated per trial: first update + median of {len(later)} later updates x {updates - 1}"
            )
    loads = {n: t["build_s"] + t["init_s"] for n, t in trials.items()}
    missing = total - len(trials)
    typical, typical_load = statistics.median(per.values()), statistics.median(loads.values())
    steady = [_median_after_first([b - a for a, b in zip([0.0, *t["t"]], t["t"])]) for t in trials.values()]
    finals = {n: t["rewards"][t["steps"].index(updates)] for n, t in trials.items() if updates in t["steps"]}
    out = {"status": part.get("status"), "trials_run": len(trials), "trials_missing": missing,
           "time_to_best_s": sum(per.values()) + missing * typical,
           "time_to_best_with_load_s": sum(per.values()) + sum(loads.values()) + missing * (typical + typical_load),
           "how": "; ".join(sorted(how)) + (f"; {missing} trial(s) not run, counted at the median trial" if missing else ""),
           "per_trial_s": per, "final_rewards": finals, "winner": best(finals) if len(finals) == total else None,
           "winner_among_run": best(finals),
           "steady_s_one_trial": statistics.median(steady),
           "steady_s_all_trials": statistics.median(steady) * total,
           "one_trial_peak_gib": max((t.get("peak_gib") or 0.0 for t in trials.values()), default=None) or None}  # fmt: skip
    return out


def trl_summary(row: dict, updates: int, trials: int) -> dict | None:
    times = row.get("update_times") or []
    if row.get("status") != "ok" or not times:
        return None
    steady = _median_after_first(times)
    one = times[0] + steady * (updates - 1)
    return {"status": "ok", "measured_updates": len(times), "steady_s_one_trial": steady,
            "time_to_best_s": one * trials, "time_to_best_with_load_s": (one + (row.get("build_s") or 0.0)) * trials,
            "how": f"extrapolated: one trial ({row.get('trial')}), {len(times)} updates measured; "
                   f"(first update + median of the later ones x {updates - 1}) x {trials} trials",
            "peak_gib": row.get("peak_gib")}  # fmt: skip


def summarize(parts: dict, args) -> dict:
    """The issue's targets from the parts' records (a ratio is None when a side is missing)."""
    n = len(trial_grid(args.kl, args.lr))
    halving = sweep_summary(parts["sweep_halving"], args.updates) if "sweep_halving" in parts else None
    every = sweep_summary(parts["sweep_all"], args.all_updates) if "sweep_all" in parts else None
    seq = sequential_summary(parts["sequential_ours"], args.updates) if "sequential_ours" in parts else None
    trl = trl_summary(parts["trl"], args.updates, n) if "trl" in parts else None
    out = {"trials": n, "updates": args.updates, "rungs": args.rungs, "keep": args.keep, "targets": TARGETS,
           "sweep_halving": halving, "sweep_all": every, "sequential_ours": seq, "trl": trl}  # fmt: skip

    def ratio(a, b):
        return a / b if a is not None and b else None

    if halving and seq:
        out["time_to_best_speedup"] = ratio(seq.get("time_to_best_s"), halving.get("time_to_best_s"))
        out["time_to_best_speedup_with_load"] = ratio(
            seq.get("time_to_best_with_load_s"), halving.get("time_to_best_with_load_s")
        )
        out["best_trial"] = {"sweep_halving": halving.get("winner"), "sequential_ours": seq.get("winner")}
        out["same_best_trial"] = (
            halving.get("winner") == seq.get("winner")
            if halving.get("winner") and seq.get("winner")
            else None
        )
    if halving and trl:
        out["time_to_best_speedup_vs_trl"] = ratio(trl["time_to_best_s"], halving.get("time_to_best_s"))
    # steady throughput: every trial together against the same trials one after another
    source = every if every and every.get("steady_s_all_trials") else halving
    if seq and source and source.get("steady_s_all_trials"):
        out["steady_throughput_ratio"] = ratio(seq["steady_s_all_trials"], source["steady_s_all_trials"])
        out["steady_throughput_from"] = (
            "sweep_all" if source is every else "sweep_halving (updates before the first rung)"
        )
    peaks = [p.get("peak_gib") for p in (halving, every) if p and p.get("peak_gib")]
    if seq and peaks:
        out["peak_memory_ratio"] = ratio(max(peaks), seq.get("one_trial_peak_gib"))
    out["meets"] = {k: (out[k] >= v if k != "peak_memory_ratio" else out[k] <= v)
                    for k, v in TARGETS.items() if out.get(k) is not None}  # fmt: skip
    return out


def csv_rows(parts: dict, summary: dict) -> list[dict]:
    rows = []
    for name in parts:
        s = summary.get(name) or {}
        rows.append({"part": name, "status": parts[name].get("status"), "time_to_best_s": s.get("time_to_best_s"),
                     "time_to_best_with_load_s": s.get("time_to_best_with_load_s"), "how": s.get("how"),
                     "steady_s_all_trials": s.get("steady_s_all_trials"), "winner": s.get("winner"),
                     "peak_gib": s.get("peak_gib", s.get("one_trial_peak_gib"))})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------- chart
def plot(parts: dict, summary: dict, path: Path, args) -> Path | None:
    """Left: each trial's reward against the wall time of the halving run (a stopped trial's line ends where
    it stopped; dotted lines: the rungs' decisions). Right: time to the best trial per part."""
    halving = parts.get("sweep_halving") or {}
    bars = [(name, s["time_to_best_s"], s.get("how", "")) for name in PARTS
            if (s := summary.get(name)) and s.get("time_to_best_s")]  # fmt: skip
    if not halving.get("trials") and not bars:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    for name, t in (halving.get("trials") or {}).items():
        if t["t"]:
            left.plot(t["t"], t["rewards"], marker="o", markersize=2.5, linewidth=1, label=name)
    ends = {r["update"]: r["t"] for r in rounds(halving)} if halving.get("trials") else {}
    for i, d in enumerate(halving.get("decisions") or []):
        if d["update"] in ends:
            left.axvline(ends[d["update"]], color="grey", linestyle=":", linewidth=1,
                         label="halving (rung)" if i == 0 else None)  # fmt: skip
    left.set(xlabel="seconds from train() (first update's capture included)", ylabel="reward (objective/scores)",
             title=f"sweep_halving: {summary['trials']} trials, rungs {args.rungs}, keep {args.keep}")  # fmt: skip
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    if bars:
        right.barh(
            range(len(bars)),
            [b[1] for b in bars],
            color=["C2" if "extrapolated" in b[2] else "C0" for b in bars],
        )
        right.set_yticks(
            range(len(bars)), [b[0] + (" (extrap.)" if "extrapolated" in b[2] else "") for b in bars]
        )
        ref = summary.get("sweep_halving", {}) and summary["sweep_halving"].get("time_to_best_s")
        for y, (_, v, _) in enumerate(bars):
            right.text(v, y, f" {v:,.1f} s" + (f" ({v / ref:.1f}x)" if ref else ""), va="center", fontsize=8)
        right.set_xlim(0, max(b[1] for b in bars) * 1.35)
    right.set(
        xlabel="seconds until the best trial's final reward is known",
        title=f"{args.shape}, U = {args.updates}",
    )
    right.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json / results.csv / sweep.png")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the tiny smoke shape, 8 + 8 tokens, batch 4, 2 x 2 trials, 5 updates, rungs 2, 3")  # fmt: skip
    p.add_argument("--parts", type=lambda s: [x for x in s.split(",") if x], default=list(PARTS),
                   help=f"comma-separated, run in this order; of {', '.join(PARTS)}")  # fmt: skip
    p.add_argument("--shape", default="llama-1.1b", choices=sorted(SHAPES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="prompts per trial and update")
    p.add_argument("--micro", type=int, default=8, help="per_device_train_batch_size of every trial")
    p.add_argument("--kl", type=floats, default=None, help="kl_coef axis of the grid (default 0.01,0.1)")
    p.add_argument("--lr", type=floats, default=None,
                   help="learning-rate axis (default 3e-5,1e-4,3e-4,1e-3; --smoke: 3e-5,1e-3)")  # fmt: skip
    p.add_argument("--updates", type=int, default=12, help="U: updates of every trial that is not stopped")
    p.add_argument("--rungs", type=ints, default=[3, 6], help="successive halving: the rungs (updates)")
    p.add_argument("--keep", type=float, default=0.5, help="successive halving: fraction kept at each rung")
    p.add_argument(
        "--seq-updates", type=int, default=None, help="sequential_ours: updates per trial (default U)"
    )
    p.add_argument("--all-updates", type=int, default=None, help="sweep_all: updates (default U)")
    p.add_argument("--trl-updates", type=int, default=3, help="trl: updates of the one stock trial measured")
    p.add_argument("--decode-mode", default="auto", choices=["auto", "compile", "cuda_graph", "eager"],
                   help="rollout_decode_mode of our parts (auto: PPOConfig's default)")  # fmt: skip
    p.add_argument("--train-rows", type=int, default=None,
                   help="PPOSweep(train_rows_per_forward=N): the most rows one training forward packs across "
                        "trials (default: the throughput planner's merge limit; the micro-batch bounds memory)")  # fmt: skip
    p.add_argument("--sweep-plan", default="on", choices=["on", "off"],
                   help="the sweeps' throughput plan (sweep/planning.py); off: the fixed rule it replaced "
                        "(16,384 tokens per training forward, scoring chunks of 64 rows)")  # fmt: skip
    p.add_argument("--decode-routing", default="auto", choices=["auto", "blocks", "index"],
                   help="the sweeps' adapter routing in the batched decode (AdapterBank.decode_routing)")  # fmt: skip
    p.add_argument("--timeouts", type=lambda s: dict((k, float(v)) for k, v in (x.split("=") for x in s.split(",") if x)),
                   default={}, help="seconds per part, e.g. sweep_halving=170,trl=70 (default --timeout)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600, help="seconds of a part without its own --timeouts")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all parts together: a part gets min(its timeout, what is left); one "
                        "with less than 30 s left is skipped")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.prompt_len, args.response_len, args.batch, args.micro = "smoke", 8, 8, 4, 4
        args.updates, args.rungs = 5, [2, 3]
        args.lr = args.lr or [3e-5, 1e-3]  # 4 trials: halving keeps 2, then 1
    args.kl = args.kl or [0.01, 0.1]
    args.lr = args.lr or [3e-5, 1e-4, 3e-4, 1e-3]
    args.seq_updates = args.seq_updates or args.updates
    args.all_updates = args.all_updates or args.updates
    unknown = set(args.parts) - set(PARTS) | set(args.timeouts) - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    if not 0 < args.keep < 1 or not args.rungs or max(args.rungs) >= args.updates:
        p.error(f"--keep must be in (0, 1) and --rungs {args.rungs} below --updates {args.updates}")
    if min(args.seq_updates, args.all_updates, args.trl_updates) < 2 or args.seq_updates > args.updates:
        p.error("--seq-updates, --all-updates and --trl-updates must be >= 2 (one warm-up, one timed); "
                "--seq-updates at most --updates")  # fmt: skip
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(smoke=args.smoke)
    env["command"] = " ".join(
        ["python", "benchmarks/sweep/run.py", *(sys.argv[1:] if argv is None else argv)]
    )
    parts: dict[str, dict] = {}
    t_start = time.perf_counter()
    for i, name in enumerate(args.parts, 1):
        timeout = args.timeouts.get(name, args.timeout)
        if args.budget_s is not None:
            timeout = min(timeout, args.budget_s - (time.perf_counter() - t_start))
        print(f"[{i}/{len(args.parts)}] {name} (timeout {timeout:.0f} s) ...", flush=True)
        if timeout < 30:
            parts[name] = {"part": name, "status": "skipped", "error": f"{timeout:.0f} s of --budget-s left"}
        elif name == "trl":
            parts[name] = run_trl(part_config(name, args), timeout)
        else:
            parts[name] = run_part(part_config(name, args), timeout)
        summary = summarize(parts, args)
        brief = {k: v for k, v in (summary.get(name) or {}).items() if not isinstance(v, (dict, list))}
        print(
            json.dumps({"part": name, "status": parts[name].get("status"), **brief}, default=str), flush=True
        )
        if parts[name].get("status") != "ok":
            print(f"  {str(parts[name].get('error'))[-400:]}", flush=True)
        write_json(
            out / "results.json", {"environment": env, "summary": summary, "parts": list(parts.values())}
        )
        write_csv(out / "results.csv", csv_rows(parts, summary))
        plot(parts, summary, out / "sweep.png", args)
    print(json.dumps({k: summary.get(k) for k in ("time_to_best_speedup", "same_best_trial", "best_trial",
                                                  "steady_throughput_ratio", "peak_memory_ratio", "meets")}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
