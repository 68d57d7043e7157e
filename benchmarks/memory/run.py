"""Memory benchmark: fragmentation with and without MemoryCompactionCallback, and checkpointing levels.

On CUDA (the 1.1B Llama shape, bf16, AdamW, micro-batch 4, sequences of 512/2048/4096 tokens in random
order, jittered):

- ``allocator/native`` and ``allocator/expandable``: the same 24 steps without the callback, with the
  callback as ``PPOTrainer`` / ``enable_rapidfire`` install it (``callback_default``: threshold 0.3,
  ``balanced``, threshold compactions only at 85% of the GPU reserved) and with it at
  thresholds 1.0 (samples only: its time cost) and 0.3 (``aggressive``, no pressure condition; 0.15 with
  ``--variants``); reserved memory and fragmentation after every step (the sawtooth), peak reserved,
  compactions, allocator retries. Then the largest micro-batch at 2048 tokens from an empty cache, and
  right after the fragmenting schedule without and with the default callback (``--batch-variants``).
- ``checkpointing``: each ``memory.optimization`` level at 4096 tokens: peak allocated memory, step time,
  largest micro-batch at 2048 tokens.

Each group runs in its own process, since the allocator is configured when CUDA initialises (the native
group with ``expandable_segments:False`` set explicitly, so the callback's default leaves it alone).

Time cost of the callback: within an allocator group, one untimed warm-up pass of the whole schedule runs
first; then ``--rounds`` rounds, each running every variant once (a 24-step window, all steps timed) in an
order that changes from round to round (Williams Latin square). Every window starts from the same state
(optimizer state cleared, allocator cache emptied, peak counters reset), so its memory numbers are its own.
The summary gives each variant's median step time and median round total, and per callback variant the
median of the paired per-round differences (callback minus no callback, same round) with min and max, in
seconds and relative to that round's no-callback total. On CPU (``--smoke``) the times are noise.

Usage::

    python benchmarks/memory/run.py --out benchmarks/memory/results/h200/first_run     # GPU, all groups, 6-7 minutes
    python benchmarks/memory/run.py --out DIR --groups allocator/native,allocator/expandable   # 5-6 minutes
    python benchmarks/memory/run.py --out /tmp/mem-smoke --smoke             # CPU, under a minute

Writes ``results.json`` (with GPU name, versions, date) and ``memory.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import write_json  # noqa: E402

ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"
# The native allocator, said explicitly: with no setting, the callback's default expandable_segments=True
# would switch the process to expandable segments at run time (CUDA is up by then).
NATIVE = "expandable_segments:False"
# group -> (scenario, allocator setting of its process)
GROUPS = {
    "allocator/native": ("allocator", NATIVE),
    "allocator/expandable": ("allocator", EXPANDABLE),
    "checkpointing": ("checkpointing", EXPANDABLE),
}
ALLOCATOR_GROUPS = ("allocator/native", "allocator/expandable")


CPU_NOTE = "CPU smoke run: a tiny model on the CPU; every time here is noise, only the plumbing is checked"


def run_group(name: str, out: Path, smoke: bool, inline: bool, opts: dict) -> dict:
    """Run one group; ``opts``: ``rounds``, ``variants``, ``batch_variants`` (lists of names)."""
    scenario, alloc = GROUPS[name]
    path = out / f"{name.replace('/', '_')}.json"
    if inline:  # smoke on CPU: no allocator to configure, skip the process start
        cfg = workloads.setting(smoke)
        cfg.update(out_dir=str(out), **opts)
        return workloads.SCENARIOS[scenario](cfg)
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARS}
    env.update(dict.fromkeys(ALLOC_VARS, alloc))
    cmd = [sys.executable, str(HERE / "workloads.py"), scenario, str(path), "--rounds", str(opts["rounds"])]
    cmd += [
        "--variants",
        ",".join(opts["variants"]),
        "--batch-variants",
        ",".join(opts["batch_variants"]) or "none",
    ]
    cmd += ["--smoke"] if smoke else []
    subprocess.run(cmd, env=env, check=True)
    return json.loads(path.read_text())


def meta(smoke: bool, opts: dict, groups: list[str]) -> dict:
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
        "groups": groups,
        "setting": {**workloads.setting(smoke), **opts},
        "timing_method": "warm-up pass, then interleaved rounds; paired per-round differences",
        "command": " ".join(sys.argv),
    }


def _gib(value):
    return value / 2**30 if value else None


def summarize(results: dict) -> dict:
    """The headline numbers: time cost of the callback, peak reserved by variant, what each level buys, and
    the largest micro-batch with and without the callback after the fragmenting schedule.

    Memory numbers are from each variant's first timed window (``*_rounds`` lists every window's); times
    are medians over the rounds, and ``time_cost`` is the paired per-round difference against no callback.
    """
    out = {}
    if results["meta"]["smoke"]:
        out["note"] = CPU_NOTE
    for group in ALLOCATOR_GROUPS:
        if group not in results:
            continue
        g = results[group]
        out[group] = {"rounds": g["rounds"], "orders": g["orders"], "orders_balanced": g["orders_balanced"]}
        for name in g["variants"]:
            v = g[name]
            out[group][name] = {
                "max_reserved_gib": _gib(v["max_reserved"]),
                "max_reserved_gib_rounds": [_gib(w["max_reserved"]) for w in v["rounds"]],
                "mean_fragmentation": v["mean_fragmentation"],
                "compactions": v["compactions"],
                "compactions_rounds": [w["compactions"] for w in v["rounds"]],
                "alloc_retries": v["alloc_retries"],
                "step_s_median": v["step_s_median"],
                "round_total_s_median": v["total_s_median"],
                "callback_s_median": v["callback_s_median"],
            }
            if name in g["time_cost"]:
                cost = g["time_cost"][name]
                out[group][name]["time_cost"] = cost
                compactions = statistics.median(w["compactions"] for w in v["rounds"])
                # what one compaction costs (its call plus the cudaMallocs of the next step), for rates
                # other than this window's; None when the variant did not compact
                out[group][name]["cost_per_compaction_s"] = (
                    (cost["diff_s"]["median"] - g["time_cost"]["callback_t1.0"]["diff_s"]["median"])
                    / compactions
                    if compactions and "callback_t1.0" in g["time_cost"]
                    else None
                )
        out[group]["callback_settings"] = g["callback_settings"]
        out[group]["largest_micro_batch"] = g["largest_micro_batch"]
        mb = g["micro_batch"]
        out[group]["micro_batch"] = {
            "search_len": mb["search_len"],
            "clean": mb["clean"],
            "after_schedule": {name: v["largest"] for name, v in mb["after_schedule"].items()},
            "retries_at_largest": {
                name: next((p["alloc_retries"] for p in v["probes"] if p["batch"] == v["largest"]), None)
                for name, v in mb["after_schedule"].items()
            },
        }
    if "checkpointing" in results:
        out["checkpointing"] = results["checkpointing"]
    return out


def time_cost_lines(summary: dict) -> list[str]:
    """One readable line per callback variant: median paired difference [min, max]."""
    lines = []
    for group in ALLOCATOR_GROUPS:
        if group not in summary:
            continue
        g = summary[group]
        for name, v in g.items():
            if not isinstance(v, dict) or "time_cost" not in v:
                continue
            c = v["time_cost"]
            d, r = c["diff_s"], c["rel"]
            rel = f" = {r['median']:+.1%} [{r['min']:+.1%}, {r['max']:+.1%}]" if r else ""
            lines.append(
                f"{group:22s} {name:16s} vs no_callback: {d['median']:+.3f} s per round "
                f"[{d['min']:+.3f}, {d['max']:+.3f}]{rel} over {g['rounds']} rounds; "
                f"median step {v['step_s_median'] * 1e3:.1f} ms "
                f"(no callback {g['no_callback']['step_s_median'] * 1e3:.1f} ms); "
                f"{v['compactions']} compactions, peak reserved {v['max_reserved_gib'] or 0:.1f} GiB "
                f"(no callback {g['no_callback']['max_reserved_gib'] or 0:.1f})"
            )
    return lines


def micro_batch_lines(summary: dict) -> list[str]:
    """One line per allocator group: the largest micro-batch clean, and after the schedule by variant."""
    lines = []
    for group in ALLOCATOR_GROUPS:
        if group not in summary:
            continue
        mb = summary[group]["micro_batch"]
        after = (
            ", ".join(
                f"{name} {largest} (allocator retries in that step: {mb['retries_at_largest'][name]})"
                for name, largest in mb["after_schedule"].items()
            )
            or "not searched (--batch-variants none)"
        )
        lines.append(
            f"{group:22s} at {mb['search_len']} tokens: empty cache {mb['clean']}; after the schedule: {after}"
        )
    return lines


def chart(results: dict, path: Path) -> None:
    """Six panels: reserved after each step, fragmentation, time cost, peak reserved by variant, the
    largest micro-batch (empty cache vs after the schedule), checkpointing levels; absent groups leave
    their panels empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(g, style) for g, style in zip(ALLOCATOR_GROUPS, ("-", "--")) if g in results]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    ax = axes[0, 0]
    for group, style in groups:
        for name in ("no_callback", "callback_t0.3", "callback_default"):
            if name not in results[group]["variants"]:
                continue
            steps = results[group][name]["steps"]
            ax.plot(
                [s["step"] for s in steps],
                [(s["reserved"] or 0) / 2**30 for s in steps],
                style,
                label=f"{group.split('/')[1]}, {name}",
            )
    ax.set(title="reserved after each step (GiB), first timed window", xlabel="step")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for group, style in groups:
        for name in ("no_callback", "callback_default"):
            if name not in results[group]["variants"]:
                continue
            steps = results[group][name]["steps"]
            ax.plot(
                [s["step"] for s in steps],
                [s["fragmentation"] or 0 for s in steps],
                style,
                label=f"{group.split('/')[1]}, {name}",
            )
    ax.set(title="fragmentation 1 - allocated/reserved", xlabel="step")
    ax.legend(fontsize=8)

    def bars(ax, values: dict, ylabel: str, title: str, errors: dict | None = None):
        """Grouped bars: values[group][name] (None: not measured)."""
        names = list(dict.fromkeys(n for g in values.values() for n in g))
        width = 0.8 / max(1, len(values))
        for i, (group, per_name) in enumerate(values.items()):
            xs = [j + i * width for j, n in enumerate(names) if per_name.get(n) is not None]
            ys = [per_name[n] for n in names if per_name.get(n) is not None]
            err = None
            if errors is not None:
                lo_hi = [errors[group][n] for n in names if per_name.get(n) is not None]
                err = [[y - lo for y, (lo, _) in zip(ys, lo_hi)], [hi - y for y, (_, hi) in zip(ys, lo_hi)]]
            ax.bar(xs, ys, width, yerr=err, capsize=3, label=group.split("/")[-1])
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width * (len(values) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, fontsize=8, rotation=15)
        ax.set(ylabel=ylabel, title=title)
        if values:
            ax.legend(fontsize=8)

    cost, spread, peak, batch = {}, {}, {}, {}
    for group, _ in groups:
        g = results[group]
        cost[group] = {n: 100 * c["rel"]["median"] for n, c in g["time_cost"].items() if c["rel"]}
        spread[group] = {
            n: (100 * c["rel"]["min"], 100 * c["rel"]["max"]) for n, c in g["time_cost"].items() if c["rel"]
        }
        peak[group] = {n: _gib(g[n]["max_reserved"]) for n in g["variants"]}
        mb = g["micro_batch"]
        batch[group] = {"empty cache": mb["clean"]}
        batch[group].update({f"after schedule,\n{n}": v["largest"] for n, v in mb["after_schedule"].items()})
    bars(
        axes[0, 2],
        cost,
        "% of the no-callback round total",
        "time cost: paired per-round difference, median [min, max]",
        spread,
    )
    axes[0, 2].axhline(2.0, color="grey", lw=0.8, ls=":")
    bars(axes[1, 0], peak, "GiB", "peak reserved in the window")
    length = workloads.setting(results["meta"]["smoke"])["search_len"]
    bars(axes[1, 1], batch, "sequences", f"largest micro-batch at {length} tokens")
    ax = axes[1, 2]
    for level, v in results.get("checkpointing", {}).items():
        ax.scatter(v["step_s"], (v["peak_allocated"] or 0) / 2**30)
        ax.annotate(
            f"{level} (max batch {v['largest_micro_batch']})",
            (v["step_s"], (v["peak_allocated"] or 0) / 2**30),
        )
    ax.set(
        title=f"checkpointing at {workloads.setting(results['meta']['smoke'])['sac_len']} tokens"
        + ("" if "checkpointing" in results else " (not run)"),
        xlabel="step time (s)",
        ylabel="peak allocated (GiB)",
    )
    fig.suptitle(f"rapidfire memory benchmark, {results['meta']['gpu'] or 'CPU smoke'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _names(text: str) -> list[str]:
    return workloads.split_names(text)


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
    parser.add_argument(
        "--groups",
        type=_names,
        default=list(GROUPS),
        help=f"comma-separated groups to run (default: all of {', '.join(GROUPS)})",
    )
    parser.add_argument(
        "--variants",
        type=_names,
        default=list(workloads.DEFAULT_VARIANTS),
        help="comma-separated timed variants, no_callback included (default: "
        f"{','.join(workloads.DEFAULT_VARIANTS)}; known: {', '.join(workloads.CALLBACK_VARIANTS)})",
    )
    parser.add_argument(
        "--batch-variants",
        type=_names,
        default=list(workloads.BATCH_VARIANTS),
        help="comma-separated variants whose largest micro-batch is searched after the fragmenting schedule "
        f"('none': skip; default: {','.join(workloads.BATCH_VARIANTS)})",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else workloads.setting(args.smoke)["rounds"]
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown or not args.groups:
        parser.error(f"--groups: unknown or empty {unknown or args.groups}; known: {', '.join(GROUPS)}")
    try:
        workloads.check_variants(args.variants, args.batch_variants)
    except ValueError as e:
        parser.error(str(e))
    import torch

    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --smoke on a CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    inline = args.smoke and not args.isolate
    opts = {"rounds": rounds, "variants": args.variants, "batch_variants": args.batch_variants}
    groups = [g for g in GROUPS if g in args.groups]
    results = {"meta": meta(args.smoke, opts, groups)}
    results["meta"]["wall_s"] = {}
    with workloads.smoke_threads(inline):
        for group in groups:
            tick = time.perf_counter()
            results[group] = run_group(group, args.out, args.smoke, inline, opts)
            results["meta"]["wall_s"][group] = time.perf_counter() - tick
    results["summary"] = summarize(results)
    write_json(args.out / "results.json", results)
    chart(results, args.out / "memory.png")
    print(json.dumps(results["summary"], indent=1))
    if any(g in results for g in ALLOCATOR_GROUPS):
        print("\ntime cost of the callback (paired per-round differences, median [min, max]):")
        for line in time_cost_lines(results["summary"]):
            print("  " + line)
        print(
            "\nlargest micro-batch (empty cache; after the fragmenting schedule without/with the callback):"
        )
        for line in micro_batch_lines(results["summary"]):
            print("  " + line)
    print(
        "\nwall time per group: " + ", ".join(f"{g} {s:.0f} s" for g, s in results["meta"]["wall_s"].items())
    )
    if args.smoke:
        print("NOTE: " + CPU_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
