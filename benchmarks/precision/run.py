"""Adaptive-precision benchmark: (a) static fp16 vs adaptive on an fp16 overflow, (b) FP8 vs bf16 speed of
the linears of the 1.1B and 7B shapes, per backend, (c) FP8 vs bf16 training of a LlamaForCausalLM (loss,
step time, tokens/s; eager or compiled per decoder layer; 1.1B by default, 7B with bf16 weights).

Usage:
    python benchmarks/precision/run.py --out benchmarks/precision/results/h200   # one H200, ~3 minutes
    python benchmarks/precision/run.py --out /tmp/precision_smoke --smoke        # CPU, tiny shapes
    python benchmarks/precision/run.py --out DIR --parts fp8_speed --fp8-shapes llama-7b
    python benchmarks/precision/run.py --out DIR --parts fp8_loss --fp8-loss-shape llama-7b \
        --fp8-loss-weights bf16 --fp8-loss-variants bf16_compiled,torchao_tensorwise_compiled

Writes ``results.json`` (GPU, versions, date, command, numbers) and ``precision.png`` to ``--out``
(the loss part draws two panels: loss curves, and tokens/s per variant)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fp8  # noqa: E402
import bench_overflow  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import environment, write_json  # noqa: E402

PARTS = ("overflow", "fp8_speed", "fp8_loss")


def _csv(text: str, allowed, what: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    unknown = [t for t in items if t not in allowed]
    if unknown or not items:
        raise SystemExit(f"--{what}: unknown or empty {unknown or text!r}; allowed: {', '.join(allowed)}")
    return items


def _overflow_panel(ax, overflow: dict) -> None:
    runs = overflow["runs"]
    for mode, run in runs.items():
        loss = [v if math.isfinite(v) else float("nan") for v in run["loss"]]
        label = f"{mode} (non-finite steps: {run['nonfinite_loss_steps']}, switches: {len(run.get('switches', []))})"
        line = ax.plot(range(1, len(loss) + 1), loss, label=label)[0]
        bad = [i + 1 for i, v in enumerate(run["loss"]) if not math.isfinite(v)]
        if bad:  # NaN/inf losses cannot be drawn as a line: mark those steps along the top
            top = max((v for r in runs.values() for v in r["loss"] if math.isfinite(v)), default=1.0)
            ax.scatter(bad, [top] * len(bad), marker="x", color=line.get_color(), s=12)
    ax.set(xlabel="step", ylabel="training loss", title="fp16 overflow in one layer (constructed)")
    ax.legend(fontsize=8)


def _speed_panel(ax, speed: dict, gpu: str) -> None:
    shapes = list(speed["shapes"])
    variants = list(dict.fromkeys(v for s in speed["shapes"].values() for v in s["variants"]))
    width = 0.8 / max(1, len(shapes))
    for i, name in enumerate(shapes):
        entries = speed["shapes"][name]["variants"]
        values = [entries.get(v, {}).get("speedup_vs_bf16", 0.0) for v in variants]
        layers = speed["shapes"][name]["shape"]["layers"]
        bars = ax.bar(
            [j + i * width for j in range(len(variants))], values, width, label=f"{name} ({layers} layers)"
        )
        for bar, v in zip(bars, variants):
            e = entries.get(v, {})
            text = f"{e['ms']:.0f}" if "ms" in e else ("err" if "error" in e else "n/a")
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                text,
                ha="center",
                va="bottom",
                fontsize=6,
            )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(shapes) - 1) / 2 for j in range(len(variants))])
    ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="speed-up vs bf16 eager (labels: ms)", title=f"FP8 linears, fwd+bwd ({gpu or 'CPU'})")
    fp8_ran = any(
        "ms" in e and e["fp8_layers"] for s in speed["shapes"].values() for e in s["variants"].values()
    )
    if not fp8_ran and speed["fp8_unavailable_reason"]:
        ax.text(0.5, 0.5, speed["fp8_unavailable_reason"], transform=ax.transAxes, ha="center", wrap=True)
    ax.legend(fontsize=7)


def _loss_title(loss: dict) -> str:
    weights = loss.get("weights", "fp32")  # results of before the weights option: fp32 master weights
    return f"{loss['shape']}, {weights} weights, {loss['batch']} x {loss['seq']} tokens"


def _loss_panel(ax, loss: dict) -> None:
    reference = loss.get("reference", "bf16")
    for variant, entry in loss["variants"].items():
        if "loss" in entry:
            values = [v if math.isfinite(v) else float("nan") for v in entry["loss"]]
            ref = " (reference)" if variant == reference else ""
            ax.plot(
                range(1, len(values) + 1),
                values,
                label=f"{variant}{ref} (last 5: {entry['final_loss_mean_last5']:.3f})",
                lw=1.8 if ref else 1.0,
            )
    ax.set(xlabel="step", ylabel="training loss", title=f"FP8 vs bf16 training loss\n{_loss_title(loss)}")
    ax.legend(fontsize=7)


def _throughput_panel(ax, loss: dict, gpu: str) -> None:
    """Tokens/s of each loss-run variant; labels: speed-up vs compiled bf16 (compiled variants) or eager
    bf16 (eager ones), or why the variant has no number."""
    variants = list(loss["variants"])
    entries = [loss["variants"][v] for v in variants]
    tokens = loss["batch"] * loss["seq"]
    # from the median step (results of before tokens_per_s have it too)
    values = [tokens / (e["median_step_ms"] / 1e3) if "median_step_ms" in e else 0.0 for e in entries]
    base = {v: loss["variants"].get(v, {}).get("median_step_ms") for v in ("bf16", "bf16_compiled")}
    colors = ["tab:orange" if e.get("compiled") else "tab:blue" for e in entries]
    bars = ax.bar(range(len(variants)), values, color=colors)
    for bar, e, value in zip(bars, entries, values):
        if "median_step_ms" in e:
            ref = base["bf16_compiled" if e.get("compiled") else "bf16"]
            text = f"{value:,.0f}" + (f"\n{ref / e['median_step_ms']:.2f}x" if ref else "")
        else:
            text = "error" if "error" in e else "skipped"
        ax.text(
            bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom", fontsize=7
        )
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, max(values + [1.0]) * 1.4)  # room for the labels and the legend
    ax.set(
        ylabel="tokens/s (median step)", title=f"training throughput ({gpu or 'CPU'})\n{_loss_title(loss)}"
    )
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="tab:blue", label="eager (label: x vs bf16)"),
            Patch(color="tab:orange", label="compiled per layer (label: x vs bf16_compiled)"),
        ],
        fontsize=7,
        loc="upper left",
    )


def _chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = results["env"]["gpu"]
    panels = []
    for part in (p for p in PARTS if p in results):
        if part == "overflow":
            panels.append(lambda ax: _overflow_panel(ax, results["overflow"]))
        elif part == "fp8_speed":
            panels.append(lambda ax: _speed_panel(ax, results["fp8_speed"], gpu))
        else:
            panels.append(lambda ax: _loss_panel(ax, results["fp8_loss"]))
            panels.append(lambda ax: _throughput_panel(ax, results["fp8_loss"], gpu))
    cols = len(panels) if len(panels) <= 3 else 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False)
    for ax, draw in zip(axes.flat, panels):
        draw(ax)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json and precision.png")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, seconds")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS)
    )
    parser.add_argument("--fp8-shapes", default=",".join(bench_fp8.SPEED_SHAPES), help="speed: Llama shapes")
    parser.add_argument(
        "--fp8-variants",
        default=",".join(bench_fp8.SPEED_VARIANTS),
        help="speed: variants (bf16 always runs first); all: " + ",".join(bench_fp8.VARIANTS),
    )
    parser.add_argument(
        "--fp8-layers", type=int, default=None, help="speed: layers of every stack (default: 1.1B 22, 7B 8)"
    )
    parser.add_argument(
        "--fp8-loss-variants",
        default=",".join(bench_fp8.LOSS_VARIANTS),
        help="loss: variants, eager or _compiled (each decoder layer compiled); bf16 / bf16_compiled are "
        "added as the speed-ups need; all: " + ",".join(bench_fp8.VARIANTS),
    )
    parser.add_argument("--fp8-loss-steps", type=int, default=None, help="loss: steps (default 40)")
    parser.add_argument("--fp8-loss-shape", default=None, help="loss: Llama shape (default llama-1.1b)")
    parser.add_argument(
        "--fp8-loss-weights",
        choices=bench_fp8.LOSS_WEIGHTS,
        default="fp32",
        help="loss: fp32 master weights under bf16 autocast (default), or bf16 weights (pure bf16 "
        "training: the 7B shape fits one H200)",
    )
    parser.add_argument("--fp8-loss-batch", type=int, default=None, help="loss: sequences per step (8)")
    parser.add_argument("--fp8-loss-seq", type=int, default=None, help="loss: tokens per sequence (512)")
    parser.add_argument("--fp8-loss-lr", type=float, default=None, help="loss: peak learning rate (3e-4)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the variants left once this many seconds have passed (recorded as skipped)",
    )
    args = parser.parse_args(argv)
    parts = _csv(args.parts, PARTS, "parts")
    shapes = _csv(args.fp8_shapes, bench_fp8.LLAMA_SHAPES, "fp8-shapes")
    variants = _csv(args.fp8_variants, bench_fp8.VARIANTS, "fp8-variants")
    loss_variants = _csv(args.fp8_loss_variants, bench_fp8.VARIANTS, "fp8-loss-variants")
    for flag in ("fp8_loss_steps", "fp8_loss_batch", "fp8_loss_seq", "fp8_loss_lr"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be positive, got {value}")
    if args.fp8_loss_shape is not None and args.fp8_loss_shape not in bench_fp8.LLAMA_SHAPES:
        raise SystemExit(
            f"--fp8-loss-shape: unknown {args.fp8_loss_shape!r}; known: {', '.join(bench_fp8.LLAMA_SHAPES)}"
        )
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    budget = bench_fp8.Budget(args.budget_s)
    results = {"env": _environment(device), "smoke": args.smoke, "seconds": {}}

    def write() -> None:  # after each part: a later failure keeps the finished ones
        write_json(args.out / "results.json", results)

    for part in parts:
        t0 = time.perf_counter()
        if part == "overflow":
            results[part] = bench_overflow.run(args.smoke, device)
        elif part == "fp8_speed":
            results[part] = bench_fp8.run_speed(args.smoke, device, shapes, variants, args.fp8_layers, budget)
        else:
            results[part] = bench_fp8.run_loss(
                args.smoke,
                device,
                loss_variants,
                args.fp8_loss_steps,
                args.fp8_loss_shape,
                budget,
                weights=args.fp8_loss_weights,
                batch=args.fp8_loss_batch,
                seq=args.fp8_loss_seq,
                lr=args.fp8_loss_lr,
                progress=lambda partial: (results.__setitem__("fp8_loss", partial), write()),
            )
        results["seconds"][part] = time.perf_counter() - t0
        write()
    _chart(results, args.out / "precision.png")
    for mode, run in results.get("overflow", {}).get("runs", {}).items():
        print(
            f"{mode:14s} final loss {run['final_loss']:.4f}  non-finite steps {run['nonfinite_loss_steps']}"
            f"  skipped updates {run['skipped_updates']}  {run['seconds']:.1f}s"
        )
    print("seconds per part:", {k: round(v, 1) for k, v in results["seconds"].items()})
    return results


def _environment(device: torch.device) -> dict:
    env = environment(device)
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except Exception as e:  # not installed, or not loadable with this torch
        env["torchao"] = f"unavailable ({type(e).__name__})"
    return env


if __name__ == "__main__":
    main()
