"""Memory benchmark: fragmentation with and without MemoryCompactionCallback, and checkpointing levels.

On CUDA (the 1.1B Llama shape, bf16, AdamW, micro-batch 4, sequences of 512/2048/4096 tokens in random
order, jittered):

- ``allocator/native`` and ``allocator/expandable``: the same 24 steps without the callback and with it at
  compaction thresholds 1.0 (samples only: its time cost), 0.3 and 0.15; reserved memory and
  fragmentation after every step (the sawtooth), peak reserved, compactions, allocator retries; and the
  largest micro-batch at 2048 tokens.
- ``checkpointing``: each ``memory.optimization`` level at 4096 tokens: peak allocated memory, step time,
  largest micro-batch at 2048 tokens.

Each group runs in its own process, since the allocator is configured when CUDA initialises.

Time cost of the callback: within an allocator group, one untimed warm-up pass of the whole schedule runs
first; then ``--rounds`` rounds, each running every variant once (a 24-step window, all steps timed) in an
order that changes from round to round (Williams Latin square). Every window starts from the same state
(optimizer state cleared, allocator cache emptied, peak counters reset), so its memory numbers are its own.
The summary gives each variant's median step time and median round total, and per callback variant the
median of the paired per-round differences (callback minus no callback, same round) with min and max, in
seconds and relative to that round's no-callback total. On CPU (``--smoke``) the times are noise.

Usage::

    python benchmarks/memory/run.py --out benchmarks/memory/results/h200     # GPU, about 5-7 minutes
    python benchmarks/memory/run.py --out /tmp/mem-smoke --smoke             # CPU, under a minute

Writes ``results.json`` (with GPU name, versions, date) and ``memory.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402

ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"
# group -> (scenario, allocator setting of its process)
GROUPS = {
    "allocator/native": ("allocator", None),
    "allocator/expandable": ("allocator", EXPANDABLE),
    "checkpointing": ("checkpointing", EXPANDABLE),
}


CPU_NOTE = "CPU smoke run: a tiny model on the CPU; every time here is noise, only the plumbing is checked"


def run_group(name: str, out: Path, smoke: bool, inline: bool, rounds: int) -> dict:
    scenario, alloc = GROUPS[name]
    path = out / f"{name.replace('/', '_')}.json"
    if inline:  # smoke on CPU: no allocator to configure, skip the process start
        cfg = workloads.setting(smoke)
        cfg["out_dir"] = str(out)
        cfg["rounds"] = rounds
        return workloads.SCENARIOS[scenario](cfg)
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARS}
    if alloc:
        env.update(dict.fromkeys(ALLOC_VARS, alloc))
    cmd = [sys.executable, str(HERE / "workloads.py"), scenario, str(path), "--rounds", str(rounds)]
    cmd += ["--smoke"] if smoke else []
    subprocess.run(cmd, env=env, check=True)
    return json.loads(path.read_text())


def meta(smoke: bool, rounds: int) -> dict:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "smoke": smoke,
        "setting": {**workloads.setting(smoke), "rounds": rounds},
        "timing_method": "warm-up pass, then interleaved rounds; paired per-round differences",
        "command": " ".join(sys.argv),
    }


VARIANTS = ("no_callback", "callback_t1.0", "callback_t0.3", "callback_t0.15")


def summarize(results: dict) -> dict:
    """The headline numbers: time cost of the callback, peak reserved by variant, what each level buys.

    Memory numbers are from each variant's first timed window (``*_rounds`` lists every window's); times
    are medians over the rounds, and ``time_cost`` is the paired per-round difference against no callback.
    """
    out = {}
    if results["meta"]["smoke"]:
        out["note"] = CPU_NOTE
    for group in ("allocator/native", "allocator/expandable"):
        g = results[group]
        out[group] = {"rounds": g["rounds"], "orders": g["orders"]}
        for name in VARIANTS:
            v = g[name]
            out[group][name] = {
                "max_reserved_gib": v["max_reserved"] / 2**30 if v["max_reserved"] else None,
                "max_reserved_gib_rounds": [
                    w["max_reserved"] / 2**30 if w["max_reserved"] else None for w in v["rounds"]
                ],
                "mean_fragmentation": v["mean_fragmentation"],
                "compactions": v["compactions"],
                "compactions_rounds": [w["compactions"] for w in v["rounds"]],
                "alloc_retries": v["alloc_retries"],
                "step_s_median": v["step_s_median"],
                "round_total_s_median": v["total_s_median"],
                "callback_s_median": v["callback_s_median"],
            }
            if name in g["time_cost"]:
                out[group][name]["time_cost"] = g["time_cost"][name]
        out[group]["largest_micro_batch"] = g["largest_micro_batch"]
    out["checkpointing"] = results["checkpointing"]
    return out


def time_cost_lines(summary: dict) -> list[str]:
    """One readable line per callback variant: median paired difference [min, max]."""
    lines = []
    for group in ("allocator/native", "allocator/expandable"):
        g = summary[group]
        for name in VARIANTS[1:]:
            c = g[name]["time_cost"]
            d, r = c["diff_s"], c["rel"]
            rel = f" = {r['median']:+.1%} [{r['min']:+.1%}, {r['max']:+.1%}]" if r else ""
            lines.append(
                f"{group:22s} {name:15s} vs no_callback: {d['median']:+.3f} s per round "
                f"[{d['min']:+.3f}, {d['max']:+.3f}]{rel} over {g['rounds']} rounds; "
                f"median step {g[name]['step_s_median'] * 1e3:.1f} ms "
                f"(no callback {g['no_callback']['step_s_median'] * 1e3:.1f} ms)"
            )
    return lines


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    ax = axes[0]
    for group, style in (("allocator/native", "-"), ("allocator/expandable", "--")):
        for name in ("no_callback", "callback_t0.3"):
            steps = results[group][name]["steps"]
            ax.plot(
                [s["step"] for s in steps],
                [(s["reserved"] or 0) / 2**30 for s in steps],
                style,
                label=f"{group.split('/')[1]}, {name}",
            )
    ax.set(title="reserved after each step (GiB)", xlabel="step")
    ax.legend(fontsize=8)
    ax = axes[1]
    for group, style in (("allocator/native", "-"), ("allocator/expandable", "--")):
        steps = results[group]["no_callback"]["steps"]
        ax.plot(
            [s["step"] for s in steps],
            [s["fragmentation"] or 0 for s in steps],
            style,
            label=group.split("/")[1],
        )
    ax.set(title="fragmentation 1 - allocated/reserved, no callback", xlabel="step")
    ax.legend(fontsize=8)
    ax = axes[2]
    for level, v in results["checkpointing"].items():
        ax.scatter(v["step_s"], (v["peak_allocated"] or 0) / 2**30)
        ax.annotate(
            f"{level} (max batch {v['largest_micro_batch']})",
            (v["step_s"], (v["peak_allocated"] or 0) / 2**30),
        )
    ax.set(
        title=f"checkpointing at {workloads.setting(results['meta']['smoke'])['sac_len']} tokens",
        xlabel="step time (s)",
        ylabel="peak allocated (GiB)",
    )
    fig.suptitle(f"rapidfire memory benchmark, {results['meta']['gpu'] or 'CPU smoke'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and memory.png")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, in seconds")
    parser.add_argument("--isolate", action="store_true", help="one process per group even in --smoke")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds of all allocator variants (default: 4 on the GPU, 2 with --smoke)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else workloads.setting(args.smoke)["rounds"]
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --smoke on a CPU)")
    inline = args.smoke and not args.isolate
    results = {"meta": meta(args.smoke, rounds)}
    for group in GROUPS:
        results[group] = run_group(group, args.out, args.smoke, inline, rounds)
    results["summary"] = summarize(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    chart(results, args.out / "memory.png")
    print(json.dumps(results["summary"], indent=1))
    print("\ntime cost of the callback (paired per-round differences, median [min, max]):")
    for line in time_cost_lines(results["summary"]):
        print("  " + line)
    if args.smoke:
        print("NOTE: " + CPU_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
