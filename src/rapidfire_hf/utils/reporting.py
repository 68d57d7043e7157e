"""Human-facing output shared by the CLI, examples and benchmarks: a live rich table and line charts."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback


class LiveTableCallback(TrainerCallback):
    """Prints a progress bar and one table row per logged step (rich), on the main process only.

    Args:
        columns: metric key -> column title, in display order.
        title: shown above the table.
    """

    def __init__(self, columns: dict[str, str], title: str = "training"):
        from rich.console import Console

        self.columns = columns
        self.title = title
        self.console = Console()
        self._progress = None
        self._task = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console.rule(self.title)
        header = f"{'step':>5} " + " ".join(f"{t:>11}" for t in self.columns.values())
        self.console.print(header, style="bold")
        self._progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("updates", total=state.max_steps)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        cells = []
        for key in self.columns:
            value = logs.get(key)
            cells.append(f"{value:>11.4g}" if isinstance(value, (int, float)) else f"{'-':>11}")
        self.console.print(f"{state.global_step:>5} " + " ".join(cells))

    def on_step_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.update(self._task, completed=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def plot_curves(
    history: list[dict],
    path: str | Path,
    series: dict[str, str],
    title: str = "",
    x_key: str = "step",
    marks: dict[str, list[tuple[float, str]]] | None = None,
) -> Path:
    """Save one panel per metric (key -> label) of ``history`` (a list of log dicts) as a PNG.

    ``marks`` adds dashed horizontal lines to a metric's panel, ``(y, legend label)`` each (the panel's
    y range grows to show them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], series.items()):
        points = [(h.get(x_key), h[key]) for h in history if key in h]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_xlabel(x_key)
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(alpha=0.3)
        for i, (y, text) in enumerate((marks or {}).get(key, [])):
            ax.axhline(y, linestyle="--", linewidth=1, color=f"C{i + 1}", label=text)
        if (marks or {}).get(key):
            ax.legend(fontsize="x-small", loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
