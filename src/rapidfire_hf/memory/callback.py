"""``MemoryCompactionCallback``: allocator setup, fragmentation tracking, compaction and telemetry."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import TrainerCallback

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.allocator import setup_allocator
from rapidfire_hf.memory.levels import MEMORY_LEVELS
from rapidfire_hf.memory.stats import (
    MemorySample,
    MiB,
    compaction_reason,
    cuda_in_use,
    holdings,
    release_cached_memory,
    sample_memory,
)
from rapidfire_hf.memory.telemetry import TelemetryWriter, default_telemetry_dir, get_telemetry
from rapidfire_hf.utils.device_memory import device_capacity_bytes

logger = logging.getLogger(__name__)

LEVELS = tuple(MEMORY_LEVELS)
# Fewest optimizer steps between two threshold compactions, by memory.optimization level (memory/levels.py)
MIN_INTERVAL_STEPS = {n: lv.compaction_interval for n, lv in MEMORY_LEVELS.items()}
# Phase changes after which the cache is released: generation leaves KV-cache blocks whose sizes training
# never asks for again. Under memory pressure with release_after_rollout="pressure" (the default: on an
# H200 the release at every update cost 12-16% of a batch-8 PPO update and lowered no peak,
# benchmarks/presets/results/h200/release8), every time with "always".
COMPACT_ON = {("rollout", "train"), ("rollout", "training")}
RELEASE_AFTER_ROLLOUT = ("always", "pressure")
# Threshold compactions only once the allocator holds this share of the GPU (memory pressure). On an H200
# (benchmarks/memory, 1.1B Llama, sequences of 512-4096) compacting on fragmentation alone cost +3.7% of the
# step time at the default level with the native allocator (results/h200_defaults) and +11-12% under
# expandable segments at the aggressive level (results/h200), and lowered the peak only with the native
# allocator at the aggressive level; the caching allocator itself frees its cache and retries before an
# OOM. Away from pressure, compacting only costs time.
PRESSURE_FRACTION = 0.85


class MemoryCompactionCallback(TrainerCallback):
    """Keeps the CUDA caching allocator compact and writes the memory telemetry stream.

    On a CPU-only run it does no compaction and still records host RSS and tensor holdings.

    In a ``transformers.Trainer`` it samples memory at the end of every ``sample_every`` optimizer steps
    and compacts when :func:`~rapidfire_hf.memory.stats.compaction_reason` says so. A trainer with phases
    (PPO: rollout, scoring, training) also calls :meth:`phase_boundary`; the rollout→train boundary
    releases the cache under memory pressure (``release_after_rollout="pressure"``, the default) or every
    time (``"always"``).

    Args:
        config: A ``rapidfire_hf.config.MemoryConfig``, a full ``RapidFireConfig`` (its ``.memory`` is
            used) or anything with ``compaction_threshold`` and ``optimization``; keyword arguments win.
        compaction_threshold: Fragmentation (``1 - allocated/reserved``) above which to compact.
        optimization: ``conservative`` | ``balanced`` | ``aggressive``: how eagerly to compact.
        min_interval_steps: Fewest steps between threshold compactions (default from ``optimization``).
        min_release_bytes: Smallest cached amount worth releasing.
        sample_every: Steps between samples (1: every optimizer step).
        telemetry: A ``TelemetryWriter`` (default: the process-wide one) or ``False`` for none.
        telemetry_dir: Directory of the stream (default ``$RAPIDFIRE_TELEMETRY_DIR`` or
            ``<output_dir>/telemetry``).
        expandable_segments: Turn on ``expandable_segments`` unless the user configured the allocator.
        pressure_fraction: Threshold compactions only once the allocator holds this share of the GPU's
            memory (default ``PRESSURE_FRACTION`` = 0.85; 0: whatever is reserved). The rollout→train
            release waits for it only under ``release_after_rollout="pressure"``.
        release_after_rollout: ``"always"`` releases the cache at every rollout→train boundary;
            ``"pressure"`` only where the allocator holds ``pressure_fraction`` of the device (default from
            ``config``'s ``release_after_rollout``, else ``"pressure"``).

    Example:
        >>> cb = MemoryCompactionCallback(compaction_threshold=0.3)        # before the model goes to the GPU
        >>> trainer = Trainer(model=model, args=args, callbacks=[cb])      # doctest: +SKIP
        >>> cb.phase_boundary("rollout", "train", step=state.global_step)  # from a PPO loop  # doctest: +SKIP
    """

    def __init__(
        self,
        config=None,
        *,
        compaction_threshold: float | None = None,
        optimization: str | None = None,
        min_interval_steps: int | None = None,
        min_release_bytes: int = 64 * MiB,
        sample_every: int = 1,
        telemetry: TelemetryWriter | bool | None = None,
        telemetry_dir: str | None = None,
        expandable_segments: bool = True,
        pressure_fraction: float | None = None,
        release_after_rollout: str | None = None,
    ):
        config = getattr(config, "memory", config)
        threshold = (
            compaction_threshold
            if compaction_threshold is not None
            else getattr(config, "compaction_threshold", 0.3)
        )
        level = to_plain(
            optimization if optimization is not None else getattr(config, "optimization", "balanced")
        )
        if level not in LEVELS:
            raise ValueError(f"optimization={level!r}: expected one of {', '.join(LEVELS)}")
        if not 0.0 < float(threshold) <= 1.0:
            raise ValueError(f"compaction_threshold={threshold!r}: expected a number in (0, 1]")
        if sample_every < 1:
            raise ValueError(f"sample_every={sample_every!r}: expected an integer >= 1")
        self.compaction_threshold = float(threshold)
        self.optimization = level
        self.min_interval_steps = (
            min_interval_steps if min_interval_steps is not None else MIN_INTERVAL_STEPS[level]
        )
        self.min_release_bytes = min_release_bytes
        if pressure_fraction is not None and not 0.0 <= pressure_fraction <= 1.0:
            raise ValueError(f"pressure_fraction={pressure_fraction!r}: expected a number in [0, 1]")
        self.pressure_fraction = pressure_fraction
        release = to_plain(
            release_after_rollout
            if release_after_rollout is not None
            else getattr(config, "release_after_rollout", "pressure")
        )
        if release not in RELEASE_AFTER_ROLLOUT:
            raise ValueError(
                f"release_after_rollout={release!r}: expected one of {', '.join(RELEASE_AFTER_ROLLOUT)}"
            )
        self.release_after_rollout = release
        self._min_reserved: int | None | bool = False  # False: not computed yet
        self.sample_every = sample_every
        self.telemetry = get_telemetry() if telemetry is None or telemetry is True else telemetry or None
        self._shared_telemetry = telemetry is None or telemetry is True  # the process-wide writer
        self.telemetry_dir = telemetry_dir
        self.allocator_setup = setup_allocator(expandable_segments)
        self.compactions: list[dict] = []
        self.bytes_returned = 0
        self.last_sample: MemorySample | None = None
        self.phase: str | None = None
        self._step = 0
        self._last_compaction_step: int | None = None
        self._model = None
        self._optimizer = None
        self._grad_bytes: int | None = None

    # ---- public API for trainers with phases and for rules ("action: compact_memory") ----

    def sample(self, where: str, step: int | None = None) -> MemorySample:
        """Measure memory now and write it to the telemetry stream.

        Args:
            where: Label of the point in the loop (``"step_end"``, ``"phase:rollout->train"``, ...).
            step: Optimizer step (default: the last one seen).
        """
        s = sample_memory(self._model, self._optimizer)
        if self._grad_bytes is not None and not s.holdings.get("gradients"):
            # gradients are freed by zero_grad before step end: report their size at the optimizer step
            s.holdings["gradients"] = self._grad_bytes
            if "activations_and_cache" in s.holdings:
                s.holdings["activations_and_cache"] = max(
                    0, s.holdings["activations_and_cache"] - self._grad_bytes
                )
        self.last_sample = s
        if self.telemetry is not None:
            self.telemetry.memory(s, step=self._step if step is None else step, phase=self.phase, where=where)
        return s

    def compact(self, reason: str, step: int | None = None) -> int:
        """Release cached blocks now, record the compaction, and return the bytes given back."""
        step = self._step if step is None else step
        before = self.last_sample
        returned = release_cached_memory()
        self.bytes_returned += returned
        self._last_compaction_step = step
        record = {
            "step": step,
            "reason": reason,
            "bytes_returned": returned,
            "phase": self.phase,
            "fragmentation_before": before.fragmentation if before else None,
        }
        self.compactions.append(record)
        if self.telemetry is not None:
            self.telemetry.event("compaction", **record)
        logger.debug("rapidfire: compaction at step %s (%s) returned %.1f MiB", step, reason, returned / MiB)
        return returned

    def maybe_compact(self, sample: MemorySample, step: int | None = None) -> int:
        """Compact if :func:`compaction_reason` says so for ``sample``; return the bytes given back."""
        step = self._step if step is None else step
        since = None if self._last_compaction_step is None else step - self._last_compaction_step
        reason = compaction_reason(
            sample,
            self.compaction_threshold,
            since,
            self.min_interval_steps,
            self.min_release_bytes,
            self.min_reserved_bytes(),
        )
        return self.compact(reason, step) if reason else 0

    def min_reserved_bytes(self) -> int | None:
        """Reserved bytes below which threshold compactions are skipped (memory pressure), or None.

        ``pressure_fraction`` of the device's memory (default ``PRESSURE_FRACTION``, with either
        allocator; 0 compacts on the threshold whatever is reserved).
        """
        if self._min_reserved is False:
            fraction = PRESSURE_FRACTION if self.pressure_fraction is None else self.pressure_fraction
            if not fraction or not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return None  # decided again once CUDA is up
            total = device_capacity_bytes()
            self._min_reserved = int(fraction * total)
        return self._min_reserved

    def phase_boundary(self, previous: str, next_phase: str, step: int | None = None) -> int:
        """Called by a trainer between phases, e.g. ``phase_boundary("rollout", "train")``.

        Samples memory; at rollout→train compacts (the rollout's KV-cache blocks are not reused by
        training) where the allocator holds the pressure share of the device (``release_after_rollout=
        "pressure"``, the default) or every time (``"always"``); otherwise only when the threshold rule
        says so.

        Returns:
            Bytes returned by a compaction (0 when none happened).
        """
        self.phase = next_phase
        s = self.sample(f"phase:{previous}->{next_phase}", step)
        if (previous, next_phase) in COMPACT_ON and self._release_now(s):
            return self.compact(f"phase {previous}->{next_phase}", step)
        return self.maybe_compact(s, step)

    def _release_now(self, sample: MemorySample) -> bool:
        """Whether the rollout→train boundary releases the cache for ``sample``."""
        if self.release_after_rollout == "always":
            return True
        floor = self.min_reserved_bytes()
        return floor is None or (sample.reserved or 0) >= floor

    def attach(self, model=None, optimizer=None) -> None:
        """Tell a plain (non-Trainer) loop's model and optimizer, to report their holdings."""
        self._model = model if model is not None else self._model
        self._optimizer = optimizer if optimizer is not None else self._optimizer

    def start(self, output_dir: str | None = None, model=None, optimizer=None, step: int = 0) -> None:
        """Open the telemetry stream and take the first sample; ``on_train_begin`` calls it.

        A loop that is not a ``transformers.Trainer`` calls it once before its first step.

        Args:
            output_dir: Run folder; the stream goes to ``<output_dir>/telemetry`` unless ``telemetry_dir``
                or ``$RAPIDFIRE_TELEMETRY_DIR`` says otherwise.
            model: The trained model (its parameters and gradients are reported).
            optimizer: Its optimizer (its state is reported).
            step: The optimizer step training starts from.
        """
        self.attach(model, optimizer)
        self._step = step
        if self.telemetry is not None:
            # the process-wide writer follows each run's folder (an earlier trainer of this process may
            # have opened it in its own); a writer the caller built keeps its directory
            own = None if self._shared_telemetry else self.telemetry.directory
            directory = Path(self.telemetry_dir or own or default_telemetry_dir(output_dir))
            if self.telemetry.is_open and self.telemetry.directory != directory:
                self.telemetry.close()
        if self.telemetry is not None and not self.telemetry.is_open:
            path = self.telemetry.open(directory)
            logger.info(
                "rapidfire: memory telemetry in %s (watch with `rapidfire monitor --pid <pid>`)", path
            )
        if self.telemetry is not None:
            self.telemetry.event(
                "train_begin",
                step=self._step,
                allocator=self.allocator_setup,
                compaction_threshold=self.compaction_threshold,
                optimization=self.optimization,
            )
        self.sample("train_begin")

    # ---- transformers.TrainerCallback hooks ----

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.start(getattr(args, "output_dir", None), model, optimizer, state.global_step)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if (state.global_step + 1) % self.sample_every == 0:
            self.attach(model, optimizer)
            device = "cuda" if cuda_in_use() else "cpu"
            self._grad_bytes = holdings(self._model, None, device).get("gradients")

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._step = state.global_step
        if self._step % self.sample_every:
            return
        self.attach(model, optimizer)
        self.maybe_compact(self.sample("step_end"))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.telemetry is None or not logs:
            return
        values = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:
            self.telemetry.metrics(state.global_step, values)

    def on_train_end(self, args, state, control, **kwargs):
        self._step = state.global_step
        self.sample("train_end")
        if self.telemetry is not None:
            self.telemetry.event(
                "train_end",
                step=self._step,
                compactions=len(self.compactions),
                bytes_returned=self.bytes_returned,
            )
