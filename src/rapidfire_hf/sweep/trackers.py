"""Each trial logs to the trackers of ``report_to``: TensorBoard under ``<output_dir>/runs/<trial>/``, and
one W&B run per trial, the runs of a sweep grouped under the sweep's folder name.

The trackers' libraries are imported when a sweep asks for them; a missing one says what to install.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

TRACKERS = ("tensorboard", "wandb")


def requested(report_to) -> list[str]:
    """The trackers ``report_to`` names (``"none"`` and ``[]``: none).

    Raises:
        ValueError: a tracker a sweep cannot log to (named, with the ones it can).
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"report_to {unknown[0]!r}: a sweep logs each trial to {', '.join(TRACKERS)} (or 'none'); "
            "each trial's metrics.csv and log_history.json are written in any case"
        )
    return names


class TrialTrackers:
    """Opens one writer (TensorBoard) or run (W&B) per trial on its first log; :meth:`close` ends them."""

    def __init__(self, report_to, output_dir, sweep_name: str | None = None):
        self.names = requested(report_to)
        self.output_dir = Path(output_dir)
        self.group = sweep_name or self.output_dir.resolve().name
        self._open: dict[tuple[str, str], object] = {}
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as err:
                raise ImportError(
                    f"report_to tensorboard needs the tensorboard package: pip install tensorboard ({err})"
                ) from None
        if "wandb" in self.names:
            try:
                import wandb  # noqa: F401
            except ImportError as err:
                raise ImportError(
                    f"report_to wandb needs the wandb package: pip install wandb ({err})"
                ) from None

    def _writer(self, kind: str, trial):
        key = (kind, trial.name)
        if key not in self._open:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self._open[key] = SummaryWriter(log_dir=str(self.output_dir / "runs" / trial.name))
            else:
                import wandb

                self._open[key] = wandb.init(
                    project=os.environ.get("WANDB_PROJECT", "rapidfire_sweep"),
                    group=self.group,
                    name=trial.name,
                    config={**trial.overrides, "parent": trial.parent},
                    dir=str(self.output_dir),
                    reinit="create_new",
                )
        return self._open[key]

    def log(self, trial, metrics: dict, step: int) -> None:
        numbers = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        for kind in self.names:
            writer = self._writer(kind, trial)
            if kind == "tensorboard":
                for key, value in numbers.items():
                    writer.add_scalar(key, value, step)
                writer.flush()
            else:
                writer.log(numbers, step=step)

    def close(self) -> None:
        for (kind, _), writer in self._open.items():
            if kind == "tensorboard":
                writer.close()
            else:
                writer.finish()
        self._open.clear()
