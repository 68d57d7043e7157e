"""The verifier of RapidFireOptimizer: a window's verdict, and the record of what was skipped or undone.

:class:`Verifier` owns the health rules (:class:`~rapidfire_hf.optim.health.HealthMonitor`), the skip
streak, the step counters, the events and the rollback report of the current step, and is told the
clip predictor and the rollback point that a verified window moves on; the optimizer (and a
:class:`~rapidfire_hf.optim.spans.Span`) ask it for a verdict and tell it the outcome, through the
methods below. :func:`device_snapshot_fits` and :func:`snapshot_bytes` decide where a snapshot may live.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter

import torch

from rapidfire_hf.optim.bnb import eight_bit_state
from rapidfire_hf.optim.clip import ClipPredictor
from rapidfire_hf.optim.health import HealthMonitor, OptimizerEvent, read_verdict
from rapidfire_hf.optim.skips import SkipStreak
from rapidfire_hf.optim.snapshot import RollbackPoint
from rapidfire_hf.optim.spans import Rollback
from rapidfire_hf.utils.device_memory import device_free_bytes
from rapidfire_hf.utils.units import GIB

# snapshot="auto": a device snapshot (plus optimizer state not allocated yet) may take at most this share
# of the GPU memory free when the decision is made (at the first snapshot, before the first update)
SNAPSHOT_DEVICE_SHARE = 0.6
COUNTS = ("steps", "skipped", "rollbacks", "discarded")  # the counters this component keeps

logger = logging.getLogger(__name__)


class Verifier:
    """Verdicts of windows, and what the optimizer skipped or undid because of them.

    Args:
        checks: run the health rules (``rollback="auto"``); otherwise only a clip check is read.
        health: the rules and their statistics.
        streak: skipped steps in a row, raising past its limit.
        clip: the clip predictor, which keeps the true norm of each verified window.
        point: the rollback point, which counts the updates applied on top of it.
    """

    def __init__(
        self,
        checks: bool,
        health: HealthMonitor,
        streak: SkipStreak,
        clip: ClipPredictor,
        point: RollbackPoint,
    ):
        self.checks = checks
        self.health = health
        self.streak = streak
        self.clip = clip
        self.point = point
        self.counts: Counter = Counter()
        self.seconds: Counter = Counter()  # time spent verifying and rolling back
        self.events: list[OptimizerEvent] = []
        self.report = Rollback([])  # what the current step undid, published as last_rollback
        self.last_rollback: Rollback | None = None
        self.last_step_skipped = False
        # set by a trainer that replays the windows a missed clip prediction skipped (PPOTrainer); a plain
        # loop gets one warning at the first miss instead
        self.replays_missed_windows = False
        self.warned_unreplayed = False

    @property
    def step(self) -> int:
        """The index of the step in progress (as in ``OptimizerEvent.step``)."""
        return self.counts["steps"]

    def verify(self, total: torch.Tensor | None, flags: dict[str, torch.Tensor], read: bool, pipelined: bool):
        """Health flags (plus ``flags``) -> (metrics, failed rule names, [host grad norm] or []).

        ``read`` False: nothing to decide (no rules and no clip check): no host read at all.
        ``pipelined``: the hooks stepped part of the window (with the clip predictor's coefficient)."""
        if not read:
            return {}, [], []
        start = time.perf_counter()
        metrics = self.health.metrics(total) if self.checks else {}
        if self.checks:
            flags = {**self.health.flags(metrics), **flags}
        failed, host = read_verdict(flags, [total] if total is not None else [])
        self.seconds["verify"] += time.perf_counter() - start
        if host and self.clip.max_norm is not None:
            self.clip.note_read(host[0], pipelined)
        return metrics, failed, host

    def flags(self, total: torch.Tensor | None) -> tuple[dict, dict[str, torch.Tensor]]:
        """The metrics and health flags of the window (device tensors, no read: a span reads them later)."""
        metrics = self.health.metrics(total)
        return metrics, self.health.flags(metrics)

    def healthy(self, metrics: dict, host: list[float]) -> None:
        """A verified window was applied (``host``: its true gradient norm, when read)."""
        self.health.update_stats(metrics)
        self.streak.healthy()
        if host:
            self.clip.remember(host[0])
        self.point.count_applied()

    def skip(
        self, kind: str, failed: list[str], metrics: dict, host: list[float], steps_lost: int = 0
    ) -> None:
        """The window failed ``failed`` and was not applied (``kind``: ``"skip"``, or ``"rollback"`` when
        the pipeline had applied part of it)."""
        self.last_step_skipped = True
        self.counts["skipped"] += 1
        details = {"grad_norm": host[0] if host else None, "steps_lost": steps_lost}
        if "loss" in metrics:
            details["loss"] = float(metrics["loss"])  # already off the hot path: this step failed
        step = self.step
        self.events.append(OptimizerEvent(step, kind, failed, details))
        self.report.steps.append(step)
        self.report.failed[step] = failed
        if failed == ["clip_prediction"]:
            self.report.replay.append(step)
            if not self.replays_missed_windows and not self.warned_unreplayed:
                self.warned_unreplayed = True
                warnings.warn(
                    f"RapidFireOptimizer: step {step}'s predicted clip coefficient missed; the step was rolled "
                    "back and skipped. Nothing replays it in a plain loop: run the batch again (opt.last_rollback"
                    ".replay lists the skipped steps) or use clip_prediction='exact' (the default).",
                    stacklevel=4,
                )
        self.health.update_stats(metrics, failed)  # clipped, or nothing for non-finite values
        if failed != ["clip_prediction"]:  # a missed prediction is replayed, not lost
            self.streak.skipped(step, failed, details)

    def span_failed(
        self, steps: list[int], bad: int, failed: list[str], metrics: dict, norm: float | None
    ) -> None:
        """A span's verdict failed at step ``bad``: every step of ``steps`` was undone; the bad one is
        skipped (replayed when only its clip prediction missed), the others replayed."""
        self.counts["rollbacks"] += 1
        clip_only = failed == ["clip_prediction"]
        self.report.steps.extend(steps)
        self.report.failed[bad] = failed
        self.report.replay.extend(s for s in steps if s != bad or clip_only)
        self.counts["skipped"] += 1
        details = {"grad_norm": norm, "steps_lost": len(steps) - 1}
        if "loss" in metrics:
            details["loss"] = float(metrics["loss"])
        self.events.append(OptimizerEvent(bad, "rollback", failed, details))
        self.health.update_stats(metrics, failed)
        if not clip_only:
            self.streak.skipped(bad, failed, details)
        self.last_step_skipped = True

    def discarded(self) -> None:
        """The current window's gradients came from weights a verdict undid: not applied, replayed."""
        step = self.step
        self.report.steps.append(step)
        self.report.replay.append(step)
        self.last_step_skipped = True
        self.counts["discarded"] += 1

    def rolled_back(self, seconds: float) -> None:
        """A pipelined window's early buckets were restored (``seconds`` it took)."""
        self.seconds["rollback"] += seconds
        self.counts["rollbacks"] += 1

    def load_counts(self, saved: dict[str, int]) -> None:
        """The counters of a ``state_dict`` (those this component keeps)."""
        self.counts = Counter({k: v for k, v in saved.items() if k in COUNTS})

    def event(self, kind: str, failed: list[str], details: dict) -> None:
        self.events.append(OptimizerEvent(self.step, kind, failed, details))

    def take_report(self) -> Rollback | None:
        """What was undone since the last report (None: nothing), published as ``last_rollback``."""
        report, self.report = (self.report if self.report.steps else None), Rollback([])
        self.last_rollback = report
        return report

    def stats(self) -> dict:
        return {
            "steps": self.counts["steps"],
            "skipped": self.counts["skipped"],
            "consecutive_skips": len(self.streak.run),
            "rollbacks": self.counts["rollbacks"],
        }

    def begin_step(self) -> None:
        self.last_step_skipped = False

    def step_done(self) -> None:
        """Close the step: count it, start a new window of metrics, publish the rollback report."""
        self.counts["steps"] += 1
        self.health.reset_window()
        self.take_report()


def device_snapshot_fits(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[bool, dict]:
    """``snapshot="auto"``: whether a device snapshot of ``params`` (and their state) fits in
    ``SNAPSHOT_DEVICE_SHARE`` of the device memory available now, and the sizes compared (bytes:
    ``need``, ``available``; and the ``device``). CPU parameters always fit (a "device" snapshot of CPU
    tensors is host memory anyway)."""
    cuda = [p for p in params if p.is_cuda]
    if not cuda:
        return True, {}
    device = cuda[0].device
    need = snapshot_bytes(params, optimizer)
    available = device_free_bytes(device)
    return need <= SNAPSHOT_DEVICE_SHARE * available, {"need": need, "available": available, "device": device}


def warn_snapshot_fallback(sizes: dict) -> None:
    """Say why ``snapshot="auto"`` turned the gradient pipeline off, and what to pass instead."""
    logger.warning(
        "RapidFireOptimizer(snapshot='auto'): a device snapshot for rollback plus the optimizer state "
        "needs %.1f GiB, more than %.0f%% of the %.1f GiB free on %s; the gradient pipeline is turned "
        "off, so that rollback stays exact without a snapshot (each update is verified before it is "
        "applied). Pass snapshot='host' to keep the pipeline with the snapshot in pinned host memory, "
        "or rollback='off' to keep it without rollback.",
        sizes["need"] / GIB,
        100 * SNAPSHOT_DEVICE_SHARE,
        sizes["available"] / GIB,
        sizes["device"],
    )


def snapshot_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Device bytes a snapshot of ``params`` and their optimizer state needs, plus the live state not
    allocated yet (optimizers create it at their first step): Adam-style groups (``betas``) get two
    moments per parameter, momentum groups one, at the parameter's element size (1 byte for 8-bit
    optimizer state)."""
    eight_bit = eight_bit_state(optimizer)
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    total = 0
    for p in params:
        total += p.numel() * p.element_size()
        state = optimizer.state.get(p)
        if state:
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
            continue
        group = group_of.get(p, {})
        moments = 2 if "betas" in group else (1 if group.get("momentum") else 0)
        # the snapshot's copy and the live state still to be allocated
        total += 2 * moments * p.numel() * (1 if eight_bit else p.element_size())
    return total
