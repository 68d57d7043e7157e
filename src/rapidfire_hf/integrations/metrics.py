"""``rapidfire/*`` training metrics, logged through the trainer's own ``log`` path.

Going through ``Trainer.log`` (rather than calling wandb directly) means every reporter in
``args.report_to`` (W&B, TensorBoard, MLflow, ...) and ``trainer.state.log_history`` receive the same
numbers, with the trainer's step. Note that transformers' W&B reporter prefixes training keys with
``train/``, so in W&B the metrics appear as ``train/rapidfire/...``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
from transformers import TrainerCallback

from rapidfire_hf.integrations.step_hooks import add_step_observer
from rapidfire_hf.utils.units import GIB

PREFIX = "rapidfire/"

# Dense bf16 tensor-core peak per GPU, from the vendors' datasheets (FLOP/s). Matched as a substring of
# ``torch.cuda.get_device_name()``; the first match wins, so longer names come first.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """The datasheet dense bf16 peak FLOP/s of a CUDA device, or ``None`` when unknown (e.g. a CPU).

    Args:
        device: the device to look up; the current CUDA device when ``None``.

    Returns:
        FLOP/s, or ``None`` when the device is not a CUDA GPU in ``PEAK_BF16_FLOPS``.
    """
    if not torch.cuda.is_available():
        return None
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameter count without the input embeddings (the ``N`` of the 6·N FLOPs-per-token rule)."""
    model = getattr(model, "module", model)  # DDP
    if hasattr(model, "num_parameters"):
        try:
            return int(model.num_parameters(exclude_embeddings=True))
        except (TypeError, AttributeError):
            pass
    return sum(p.numel() for p in model.parameters())


def count_tokens(inputs: Any) -> int:
    """Non-padding tokens in one micro-batch of any TRL trainer's inputs.

    SFT/reward batches carry ``attention_mask``; DPO carries ``*_attention_mask`` per part;
    GRPO/RLOO carry ``prompt_mask`` and ``completion_mask``. Falls back to the size of ``input_ids``.
    """
    if not isinstance(inputs, dict):
        return 0
    masks = [
        v
        for k, v in inputs.items()
        if k.endswith("attention_mask") or k in ("prompt_mask", "completion_mask")
    ]
    masks = [m for m in masks if isinstance(m, torch.Tensor)]
    if masks:
        return int(sum(int(m.sum()) for m in masks))
    ids = inputs.get("input_ids")
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def memory_metrics(device: torch.device | None) -> dict[str, float]:
    """Allocator holdings in GiB and the fragmentation ratio ``1 - allocated / reserved``.

    On a CUDA device the numbers come from the caching allocator; on a CPU only the process RSS is known.
    """
    out: dict[str, float] = {}
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        out["memory/allocated_gib"] = allocated / GIB
        out["memory/reserved_gib"] = reserved / GIB
        out["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["memory/fragmentation"] = 1.0 - allocated / reserved if reserved else 0.0
    try:
        import psutil

        out["memory/rss_gib"] = psutil.Process(os.getpid()).memory_info().rss / GIB
    except ImportError:  # psutil is a dependency; keep logging alive if someone removed it
        pass
    return out


def _numeric(stats: Any) -> dict[str, float]:
    if not isinstance(stats, dict):
        return {}
    out = {}
    for key, value in stats.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)):
            out[str(key)] = float(value)
    return out


def part_metrics(trainer) -> dict[str, float]:
    """Counters reported by the rapidfire parts installed on ``trainer`` (optimizer, memory, precision).

    Each part's own ``stats()`` keys are kept under ``optim/``, ``memory/`` and ``precision/``, one name
    per counter (e.g. ``optim/rollbacks``, ``optim/skipped``, ``optim/hook_seconds``: the optimizer time
    spent inside backward's hooks, ``memory/compactions``, ``precision/switches``), plus ``steps_skipped``:
    the optimizer steps skipped since these metrics were last logged, with one count per reason.
    """
    from rapidfire_hf.integrations.parts import find_rapidfire_optimizer, installed_parts

    out: dict[str, float] = {}
    opt = find_rapidfire_optimizer(getattr(trainer, "optimizer", None))
    if opt is not None and hasattr(opt, "stats"):
        for key, value in _numeric(opt.stats()).items():
            out[f"optim/{key}"] = value
    parts = installed_parts(trainer)
    memory = parts.get("memory")
    if memory is not None:
        out["memory/compactions"] = float(len(getattr(memory, "compactions", [])))
        out["memory/bytes_returned"] = float(getattr(memory, "bytes_returned", 0))
    precision = parts.get("precision")
    if precision is not None:
        for key, value in _numeric(precision.stats()).items():
            out[f"precision/{key}"] = value
    skips = parts.get("skips")  # integrations/skips.py: steps skipped since these metrics were last logged
    if skips is not None:
        out.update(skips.take_counts())
    return out


class RapidFireMetricsCallback(TrainerCallback):
    """Adds ``rapidfire/*`` metrics to every training log of ``trainer`` (main process only).

    Metrics: ``tokens_per_sec`` (tokens per wall second since the previous log: the trainer's
    ``num_input_tokens_seen`` when it counts them (GRPO/RLOO always do: prompt + completion tokens of
    each generation), else the non-padding tokens of the training micro-batches),
    ``mfu`` (6·N·tokens/s over the GPU's datasheet dense bf16 peak, ``N`` = non-embedding parameters;
    training forward+backward only, so generation in GRPO/RLOO is not counted), ``step_time_s``, memory
    holdings and fragmentation, and the counters of the installed rapidfire parts.

    Args:
        trainer: the ``transformers.Trainer`` (or TRL trainer) to log through.
        peak_flops: peak FLOP/s per device for the MFU estimate; looked up from ``PEAK_BF16_FLOPS`` when
            ``None``. MFU is not logged when the peak is unknown (CPUs).
        log_every: ``logging.log_every``: the metrics go into a training log only when this many optimizer
            steps passed since they last did (their window, e.g. of ``tokens_per_sec``, spans those steps).

    Example:
        >>> trainer.add_callback(RapidFireMetricsCallback(trainer))  # doctest: +SKIP
    """

    def __init__(self, trainer, peak_flops: float | None = None, log_every: int = 1):
        from rapidfire_hf.utils.logs import LogCadence

        self.trainer = trainer
        self.peak_flops = peak_flops
        self.cadence = LogCadence(log_every)
        self._tokens = 0
        self._steps = 0
        self._window_start = time.perf_counter()
        self._seen_at_window_start = 0
        self._n_params: int | None = None
        self._wrap(trainer)

    def _wrap(self, trainer) -> None:
        # An instance attribute shadows the class's method: the TRL subclasses' own `log` (which merges
        # their metrics) still runs, and so do reporters and log_history.
        log = trainer.log

        @functools.wraps(log)
        def log_with_rapidfire(logs: dict[str, float], *args, **kwargs):
            if (
                self._is_training_log(logs)
                and trainer.is_world_process_zero()
                and self.cadence.due(trainer.state.global_step)
            ):
                logs.update(self.collect())
            return log(logs, *args, **kwargs)

        def count(model, inputs):
            self._tokens += count_tokens(inputs)

        trainer.log = log_with_rapidfire
        add_step_observer(trainer, "metrics.tokens", before=count)

    @staticmethod
    def _is_training_log(logs: dict[str, float]) -> bool:
        return "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs)

    def on_train_begin(self, args, state, control, **kwargs):
        self._window_start = time.perf_counter()
        self._tokens = self._steps = 0
        self._seen_at_window_start = state.num_input_tokens_seen
        if self.peak_flops is None:
            self.peak_flops = peak_flops(args.device)

    def on_step_end(self, args, state, control, **kwargs):
        self._steps += 1

    def collect(self) -> dict[str, float]:
        """Metrics for the window since the previous call (which starts a new window)."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        seen = self.trainer.state.num_input_tokens_seen
        # GRPO/RLOO hand training_step the raw prompts (inputs are built inside it): use their own count
        tokens = seen - self._seen_at_window_start if seen > self._seen_at_window_start else self._tokens
        tokens_per_sec = tokens / elapsed
        metrics = {"tokens_per_sec": tokens_per_sec}
        if self._steps:
            metrics["step_time_s"] = elapsed / self._steps
        if self.peak_flops:
            if self._n_params is None:
                self._n_params = non_embedding_params(self.trainer.model)
            metrics["mfu"] = 6.0 * self._n_params * tokens_per_sec / self.peak_flops
        metrics.update(memory_metrics(self.trainer.args.device))
        metrics.update(part_metrics(self.trainer))
        self._window_start, self._tokens, self._steps, self._seen_at_window_start = now, 0, 0, seen
        return {PREFIX + k: v for k, v in metrics.items()}
