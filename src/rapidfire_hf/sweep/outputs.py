"""What a sweep writes: per-trial ``metrics.csv`` and ``log_history.json``, the sweep's ``summary.json``,
``sweep_state.json`` (read by ``rapidfire sweep ctl status``), one chart, and the live table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

CHART = "sweep_curves.png"
SERIES = {"objective/scores": "reward", "objective/kl": "KL"}


def write_trial(trial) -> None:
    out = Path(trial.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    history = trial.state.log_history
    (out / "log_history.json").write_text(json.dumps(history, indent=1))
    if history:
        keys = sorted({k for h in history for k in h})
        with open(out / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(history)


def trial_summary(trial) -> dict:
    """overrides, reward_first, reward_last, kl_last, updates, state (and parent, why it stopped)."""
    hist = [h for h in trial.state.log_history if "objective/scores" in h]
    return {
        "overrides": trial.overrides,
        "reward_first": hist[0]["objective/scores"] if hist else None,
        "reward_last": hist[-1]["objective/scores"] if hist else None,
        "kl_last": hist[-1]["objective/kl"] if hist else None,
        "updates": trial.state.global_step,
        "state": trial.status,
        "parent": trial.parent,
        "reason": trial.reason,
    }


def write_state(sweep) -> None:
    out = Path(sweep.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {n: {**trial_summary(t), "num_updates": t.num_updates} for n, t in sweep.trials.items()}
    (out / "sweep_state.json").write_text(json.dumps(state, indent=1))


def write_all(sweep, wall_seconds: float | None = None) -> dict:
    """Every trial's files, ``summary.json`` and the chart; returns the summary."""
    out = Path(sweep.args.output_dir)
    for trial in sweep.trials.values():
        write_trial(trial)
    summary = {"trials": {n: trial_summary(t) for n, t in sweep.trials.items()}}
    summary["device"] = str(sweep.device)
    summary["rollout_backend"] = sweep.phases.engine.backend
    if wall_seconds is not None:
        summary["wall_seconds"] = round(wall_seconds, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_state(sweep)
    plot(sweep, out / CHART)
    return summary


def plot(sweep, path: Path) -> Path:
    """Reward and KL per update, one line per trial, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SERIES), figsize=(5.5 * len(SERIES), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], SERIES.items()):
        for name, trial in sweep.trials.items():
            pts = [(h["step"], h[key]) for h in trial.state.log_history if key in h]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=2, label=name)
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
    """A live rich table with one row per trial: state, updates, reward, KL, learning rate."""

    def __init__(self, sweep):
        from rich.live import Live

        self.sweep = sweep
        self.live = Live(self._table(), refresh_per_second=2, transient=False)
        self.live.start()

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
        self.live.update(self._table())

    def close(self) -> None:
        self.update()
        self.live.stop()
