"""Adaptive-precision benchmark: (a) static fp16 vs adaptive on an fp16 overflow, (b) FP8 vs bf16 linears.

Usage:
    python benchmarks/precision/run.py --out benchmarks/precision/results          # GPU, < 3 minutes
    python benchmarks/precision/run.py --out /tmp/precision_smoke --smoke          # CPU, seconds

Writes ``results.json`` (GPU, versions, date, command, numbers) and ``precision.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fp8  # noqa: E402
import bench_overflow  # noqa: E402
from _env import environment  # noqa: E402


def _environment(device: torch.device) -> dict:
    return environment(device)


def _chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs = results["overflow"]["runs"]
    for mode, run in runs.items():
        loss = [v if math.isfinite(v) else float("nan") for v in run["loss"]]
        label = f"{mode} (non-finite steps: {run['nonfinite_loss_steps']}, switches: {len(run.get('switches', []))})"
        line = ax1.plot(range(1, len(loss) + 1), loss, label=label)[0]
        bad = [i + 1 for i, v in enumerate(run["loss"]) if not math.isfinite(v)]
        if bad:  # NaN/inf losses cannot be drawn as a line: mark those steps along the top
            top = max((v for r in runs.values() for v in r["loss"] if math.isfinite(v)), default=1.0)
            ax1.scatter(bad, [top] * len(bad), marker="x", color=line.get_color(), s=12)
    ax1.set(xlabel="step", ylabel="training loss", title="fp16 overflow in one layer (constructed)")
    ax1.legend(fontsize=8)
    fp8 = results["fp8"]
    names, values = ["bf16"], [fp8["bf16_ms"]]
    if "fp8_ms" in fp8:
        names.append("fp8 (scaled_mm)")
        values.append(fp8["fp8_ms"])
    if "fp8_cached_ms" in fp8:
        names.append("fp8, cached weights")
        values.append(fp8["fp8_cached_ms"])
    ax2.bar(names, values, color=["tab:blue", "tab:orange", "tab:green"][: len(values)])
    ax2.set(
        ylabel="ms per forward+backward",
        title=f"linears of the 1.1B shape ({results['env']['gpu'] or 'CPU'})",
    )
    if "fp8_ms" not in fp8:
        ax2.text(0.5, 0.5, fp8["fp8_unavailable_reason"], transform=ax2.transAxes, ha="center", wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and precision.png")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, a few seconds")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"env": _environment(device), "smoke": args.smoke}
    results["overflow"] = bench_overflow.run(args.smoke, device)
    results["fp8"] = bench_fp8.run(args.smoke, device)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    _chart(results, args.out / "precision.png")
    for mode, run in results["overflow"]["runs"].items():
        print(
            f"{mode:14s} final loss {run['final_loss']:.4f}  non-finite steps {run['nonfinite_loss_steps']}"
            f"  skipped updates {run['skipped_updates']}  {run['seconds']:.1f}s"
        )
    print(json.dumps({k: v for k, v in results["fp8"].items() if k != "shape"}))
    return results


if __name__ == "__main__":
    main()
