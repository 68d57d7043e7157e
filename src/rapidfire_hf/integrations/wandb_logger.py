"""Weights & Biases: a plain metric logger (for rapidfire_hf's own trainers) and a direct-to-W&B callback.

wandb is imported only when one of these is created; without it the error says which extra to install.
"""

from __future__ import annotations

import os
from typing import Any

from rapidfire_hf.integrations.metrics import PREFIX, RapidFireMetricsCallback
from rapidfire_hf.utils.imports import require


def _is_main_process() -> bool:
    # accelerate's PartialState knows the rank under any launcher; fall back to torchrun's variable.
    try:
        from accelerate import PartialState

        return PartialState().is_main_process
    except Exception:  # noqa: BLE001 - no accelerate state (plain script): rank from the environment
        return int(os.environ.get("RANK", "0")) == 0


class WandbLogger:
    """Logs dicts of scalars to a W&B run, on the main process only (other ranks do nothing).

    Reuses the active run (``wandb.run``) when there is one, e.g. the one transformers' reporter started.

    Args:
        project: W&B project (``WANDB_PROJECT`` / W&B's default when ``None``).
        name: run name.
        config: run configuration to record (e.g. ``PPOConfig.to_dict()``).
        dir: folder for the run's files (``WANDB_DIR`` when ``None``).
        **init_kwargs: passed to ``wandb.init`` (``mode="offline"``, ``tags=...``).

    Raises:
        ImportError: wandb is not installed; the message says ``pip install 'rapidfire_hf[wandb]'``.

    Example:
        >>> logger = WandbLogger(project="ppo", config={"lr": 1e-6})  # doctest: +SKIP
        >>> logger.log({"ppo/loss": 0.3, "rapidfire/tokens_per_sec": 1500.0}, step=10)  # doctest: +SKIP
        >>> logger.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        config: dict[str, Any] | None = None,
        dir: str | None = None,
        **init_kwargs,
    ):
        self.wandb = require("wandb", "W&B logging")
        self.main = _is_main_process()
        self.run = None
        self._owns_run = False
        if not self.main:
            return
        self.run = self.wandb.run
        if self.run is None:
            self.run = self.wandb.init(project=project, name=name, config=config, dir=dir, **init_kwargs)
            self._owns_run = True
        elif config:
            self.run.config.update(config, allow_val_change=True)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log scalars (tensors of one element are converted) at ``step``."""
        if self.run is None:
            return
        clean = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        self.run.log(clean, step=step)

    def close(self) -> None:
        """Finish the run if this logger started it."""
        if self.run is not None and self._owns_run:
            self.run.finish()
        self.run = None


class RapidFireWandbCallback(RapidFireMetricsCallback):
    """``RapidFireMetricsCallback`` that also sends ``rapidfire/*`` straight to W&B.

    Use it when the trainer's ``report_to`` does not include ``"wandb"`` (with ``"wandb"`` in it, the
    plain ``RapidFireMetricsCallback`` already reaches W&B through the trainer's reporter). Keys are
    logged under ``train/rapidfire/...``, the names transformers' W&B reporter would use.

    Args:
        trainer: the trainer to log for.
        peak_flops: see ``RapidFireMetricsCallback``.
        log_every: see ``RapidFireMetricsCallback``.
        **wandb_kwargs: for ``WandbLogger`` (``project``, ``name``, ``dir``, ...).
    """

    def __init__(self, trainer, peak_flops: float | None = None, log_every: int = 1, **wandb_kwargs):
        require("wandb", "W&B logging")  # fail at construction, not at the first log
        super().__init__(trainer, peak_flops=peak_flops, log_every=log_every)
        self._wandb_kwargs = wandb_kwargs
        self._logger: WandbLogger | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or "wandb" in (args.report_to or []):
            return  # with wandb in report_to the trainer's own reporter already sends these keys
        ours = {f"train/{k}": v for k, v in (logs or {}).items() if k.startswith(PREFIX)}
        if ours:
            if self._logger is None:
                self._logger = WandbLogger(**self._wandb_kwargs)
            self._logger.log({**ours, "train/global_step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        if self._logger is not None:
            self._logger.close()
            self._logger = None
