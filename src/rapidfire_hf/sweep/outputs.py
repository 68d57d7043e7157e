"""What a sweep writes: per-trial ``metrics.csv`` and ``log_history.json``, the sweep's ``summary.json``,
``sweep_state.json`` (read by ``rapidfire sweep ctl status``), one chart, and the live table."""

from __future__ import annotations

import csv
import io
import os
import socket
import sys
import time
from pathlib import Path

from rapidfire_hf.sweep.files import write_json

CHART = "sweep_curves.png"
SERIES = {"objective/scores": "reward", "objective/kl": "KL"}


def write_trial(trial) -> None:
    out = Path(trial.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    history = trial.state.log_history
    write_json(out / "log_history.json", history)
    if history:
        keys = sorted({k for h in history for k in h})
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)
        tmp = out / f".metrics.csv.{os.getpid()}.tmp"
        tmp.write_text(text.getvalue(), encoding="utf-8", newline="")
        os.replace(tmp, out / "metrics.csv")


def trial_summary(trial) -> dict:
    """overrides, reward_first, reward_last, kl_last, updates, state (and parent, why it stopped).

    A stopped trial whose folder vanished keeps the record of the previous summary (``kept_record``)."""
    if trial.kept_record is not None and trial.state.global_step == 0:
        return {**trial.kept_record, "state": trial.status, "kept_from_previous_summary": True}
    hist = [h for h in trial.state.log_history if "objective/scores" in h]
    return {
        "overrides": trial.overrides,
        "reward_first": hist[0]["objective/scores"] if hist else None,
        "reward_last": hist[-1]["objective/scores"] if hist else None,
        "kl_last": hist[-1]["objective/kl"] if hist else None,
        "updates": trial.state.global_step,
        "state": trial.status,
        "parent": trial.parent,
        "branch_step": trial.branch_step,
        "reason": trial.reason,
    }


def write_state(sweep, status: str) -> None:
    """``sweep_state.json`` (atomically): the sweep's status and process, every trial's state, and the
    commands it refused. ``rapidfire sweep ctl`` checks its commands against it."""
    state = {
        "format": 1,
        "status": status,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "trials": {n: {**trial_summary(t), "num_updates": t.num_updates} for n, t in sweep.trials.items()},
        "messages": list(sweep.messages),
    }
    write_json(Path(sweep.args.output_dir) / "sweep_state.json", state)


def write_all(sweep, wall_seconds: float | None = None, status: str = "finished") -> dict:
    """Every trial's files, ``summary.json``, the state and the chart; returns the summary."""
    out = Path(sweep.args.output_dir)
    for trial in sweep.trials.values():
        write_trial(trial)
    summary = {"status": status, "trials": {n: trial_summary(t) for n, t in sweep.trials.items()}}
    summary["decisions"] = [d for rule in sweep.rules for d in getattr(rule, "decisions", [])]
    summary["messages"] = list(sweep.messages)
    summary["device"] = str(sweep.device)
    summary["rollout_backend"] = sweep.phases.engine.backend
    plan = sweep.planner.plan  # the throughput plan of the last update (None before the first)
    summary["plan"] = None if plan is None else plan.to_dict()
    if wall_seconds is not None:
        summary["wall_seconds"] = round(wall_seconds, 2)
    write_json(out / "summary.json", summary, indent=2)
    write_state(sweep, status)
    plot(sweep, out / CHART)
    return summary


def curve(trial, key: str) -> list[tuple[int, float]]:
    """``[(update, value), ...]`` of one trial's chart line: a clone's starts where it left its parent
    (its history before that is the parent's, drawn by the parent's line)."""
    branch = trial.branch_step or 0
    return [(h["step"], h[key]) for h in trial.state.log_history if key in h and h.get("step", 0) >= branch]


def plot(sweep, path: Path) -> Path:
    """Reward and KL per update, one line per trial, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = sorted({d["update"] for rule in sweep.rules for d in getattr(rule, "decisions", [])})
    fig, axes = plt.subplots(1, len(SERIES), figsize=(5.5 * len(SERIES), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], SERIES.items()):
        for name, trial in sweep.trials.items():
            pts = curve(trial, key)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=2, label=name)
        for i, rung in enumerate(rungs):
            ax.axvline(rung, color="grey", linestyle=":", linewidth=1, label="halving" if i == 0 else None)
        ax.set_xlabel("update")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"PPOSweep: {len(sweep.trials)} trials on one shared base")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class SweepProgress:
    """A live rich table with one row per trial: state, updates, reward, KL, learning rate. Off a terminal
    (a log file, CI) one line per update instead: a redrawn table there is unreadable."""

    def __init__(self, sweep):
        self.sweep = sweep
        self.live = None
        if not sys.stdout.isatty():
            # a log file hears at once what follows: the first update can be minutes away on a large model
            print(
                f"PPOSweep started: {len(sweep.trials)} trials ({', '.join(sweep.trials)}), output in "
                f"{sweep.args.output_dir}; one line per update follows",
                flush=True,
            )
            return
        from rich.live import Live

        self.live = Live(self._table(), refresh_per_second=2, transient=False)
        self.live.start()

    def _line(self) -> str:
        parts = []
        for name, t in self.sweep.trials.items():
            last = t.state.log_history[-1] if t.state.log_history else {}
            reward = f" {last['objective/scores']:.4f}" if "objective/scores" in last else ""
            parts.append(
                f"{name} {t.state.global_step}/{t.num_updates}{reward}"
                + ("" if t.status == "running" else f" {t.status}")
            )
        return "PPOSweep: " + " | ".join(parts)

    def _table(self):
        from rich.table import Table

        table = Table(title=f"PPOSweep: {self.sweep.args.output_dir}")
        for col in ("trial", "state", "update", "reward", "KL", "lr"):
            table.add_column(col, justify="left" if col in ("trial", "state") else "right")
        for name, t in self.sweep.trials.items():
            last = t.state.log_history[-1] if t.state.log_history else {}

            def cell(key, fmt="{:.4f}", last=last):
                return fmt.format(last[key]) if key in last else "-"

            status = t.status if not (t.done and t.status == "running") else "finished"
            table.add_row(
                name, status, f"{t.state.global_step}/{t.num_updates}",
                cell("objective/scores"), cell("objective/kl"), cell("lr", "{:.2e}"),
            )  # fmt: skip
        return table

    def update(self) -> None:
        if self.live is None:
            print(self._line(), flush=True)
        else:
            self.live.update(self._table())

    def close(self) -> None:
        if self.live is not None:
            self.update()
            self.live.stop()
