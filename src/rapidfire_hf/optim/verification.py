"""The verification half of RapidFireOptimizer: verdicts, skips, snapshots and the window plan.

A mixin so that ``optimizer.py`` holds the public surface and the step, and this file the decisions
behind it. It reads the attributes that ``RapidFireOptimizer.__init__`` sets.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch

from rapidfire_hf.optim.health import OptimizerEvent, read_verdict
from rapidfire_hf.optim.pipeline import accelerate_flag
from rapidfire_hf.utils.units import GIB

CLIP_HISTORY = 8  # windows of gradient norms the clip prediction looks at
CLIP_BACKOFF_MAX = 16  # most windows stepped exactly after a missed clip prediction (optimizer.py)
CLIP_EPS = 1e-6  # the epsilon of torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)
# snapshot="auto": a device snapshot (plus optimizer state not allocated yet) may take at most this share
# of the GPU memory free when the decision is made (at the first snapshot, before the first update)
SNAPSHOT_DEVICE_SHARE = 0.6

logger = logging.getLogger(__name__)


def _multi_process() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


class VerificationMixin:
    """Verification, rollback bookkeeping and the pipelined-or-deferred decision of each window."""

    def _verify(self, total: torch.Tensor | None, flags: dict[str, torch.Tensor], read: bool):
        """Health flags (plus ``flags``) -> (metrics, failed rule names, [host grad norm] or [])."""
        if not read:
            return {}, [], []
        start = time.perf_counter()
        metrics = self._health.metrics(total) if self.rollback == "auto" else {}
        if self.rollback == "auto":
            flags = {**self._health.flags(metrics), **flags}
        failed, host = read_verdict(flags, [total] if total is not None else [])
        self._seconds["verify"] += time.perf_counter() - start
        if host and self.max_grad_norm is not None:
            pipelined = self._pipeline is not None and self._pipeline.window_pipelined
            predicted = self._coef_pred if pipelined else None
            self._last_coef = (predicted, min(1.0, self.max_grad_norm / (host[0] + CLIP_EPS)))
        return metrics, failed, host

    def _skip(
        self, kind: str, failed: list[str], metrics: dict, host: list[float], steps_lost: int = 0
    ) -> None:
        self.last_step_skipped = True
        self._counters["skipped"] += 1
        details = {"grad_norm": host[0] if host else None, "steps_lost": steps_lost}
        if "loss" in metrics:
            details["loss"] = float(metrics["loss"])  # already off the hot path: this step failed
        step = self._counters["steps"]
        self.events.append(OptimizerEvent(step, kind, failed, details))
        self._report.steps.append(step)
        self._report.failed[step] = failed
        if failed == ["clip_prediction"]:
            self._report.replay.append(step)
            if not self.replays_missed_windows and not self._warned_unreplayed:
                self._warned_unreplayed = True
                warnings.warn(
                    f"RapidFireOptimizer: step {step}'s predicted clip coefficient missed; the step was rolled "
                    "back and skipped. Nothing replays it in a plain loop: run the batch again (opt.last_rollback"
                    ".replay lists the skipped steps) or use clip_prediction='exact' (the default).",
                    stacklevel=4,
                )
        self._health.update_stats(metrics, failed)  # clipped, or nothing for non-finite values
        if failed != ["clip_prediction"]:  # a missed prediction is replayed, not lost
            self._streak.skipped(step, failed, details)

    def _remember_norm(self, norm: float) -> None:
        self._norm_history = (self._norm_history + [norm])[-CLIP_HISTORY:]

    def _after_healthy(self, metrics: dict, host: list[float]) -> None:
        self._health.update_stats(metrics)
        self._streak.healthy()
        if host:
            self._remember_norm(host[0])
        self._applied_since_snapshot += 1

    def _snapshot_ready(self, params: list[torch.Tensor]) -> bool:
        """Whether the snapshot holds ``params`` at a verified state recent enough to restore."""
        held = self._snapshot_params
        return (
            self._snapshot.taken
            and self._applied_since_snapshot < self.snapshot_interval
            and len(held) == len(params)
            and all(a is b for a, b in zip(held, params))
        )

    def _ensure_snapshot(self) -> bool:
        """Before the hooks apply anything in a window: snapshot the parameters they may step (the early
        buckets) and their state, unless a recent enough snapshot holds them. Returns False when
        ``snapshot="auto"`` turned the pipeline off instead (defer the window)."""
        if self._snapshot_auto:
            self._decide_snapshot()
            if not self.pipeline_enabled:
                return False
        params = self._pipeline.early_params
        if not self._snapshot_ready(params):
            self._snapshot.capture(params, self._inner, self._counters["steps"])
            self._snapshot_params = params
            self._applied_since_snapshot = 0
        return True

    def _decide_snapshot(self) -> None:
        """``snapshot="auto"``, once, before the first snapshot: keep it on the device when it fits (it is
        the fast place: a device copy of 6.15 GiB took 6-8 ms on an H200, a pinned host copy ~125 ms);
        otherwise turn the gradient pipeline off. Rollback stays exact without any snapshot then,
        because a window stepped in ``step()`` is verified before it is applied; the pipeline would
        have saved one gradient copy, the snapshot costs the parameters plus the optimizer state."""
        self._snapshot_auto = False
        params = self._params
        cuda = [p for p in params if p.is_cuda]
        if not cuda:
            return  # a "device" snapshot of CPU tensors is host memory anyway
        device = cuda[0].device
        need = snapshot_bytes(params, self._inner)
        free, _ = torch.cuda.mem_get_info(device)
        available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if need <= SNAPSHOT_DEVICE_SHARE * available:
            return
        self.disable_pipeline()
        self._counters["snapshot_fallbacks"] += 1
        details = {"need_gib": need / GIB, "available_gib": available / GIB}
        self.events.append(OptimizerEvent(self._counters["steps"], "snapshot_auto_pipeline_off", [], details))
        logger.warning(
            "RapidFireOptimizer(snapshot='auto'): a device snapshot for rollback plus the optimizer state "
            "needs %.1f GiB, more than %.0f%% of the %.1f GiB free on %s; the gradient pipeline is turned "
            "off, so that rollback stays exact without a snapshot (each update is verified before it is "
            "applied). Pass snapshot='host' to keep the pipeline with the snapshot in pinned host memory, "
            "or rollback='off' to keep it without rollback.",
            need / GIB,
            100 * SNAPSHOT_DEVICE_SHARE,
            available / GIB,
            device,
        )

    def _plan_window(self) -> bool:
        """Called at the first closing hook: step in the hooks this window, or defer to ``step()``?"""
        reason = None
        if self._span_mode and self._verdict is not None:  # the last span's verdict, before any update
            self._resolve(mid_window=True)
        if self._discard:
            reason = "rolled_back"  # this window's gradients came from undone weights: replayed
        elif _multi_process():
            reason = "distributed"  # hooks fire before the gradient all-reduce has finished
        elif accelerate_flag("_mixed_precision", "AcceleratorState") == "fp16":
            reason = "fp16_loss_scaling"  # gradients are still scaled when the hooks fire
        elif not any(b.early for b in self._pipeline.buckets):
            reason = "no_early_bucket"  # pipeline_share 0: every bucket waits for step()
        coef = 1.0
        if reason is None and self.max_grad_norm is not None and self._clip_backoff > 0:
            self._clip_backoff -= 1
            reason = "recent_clip_miss"  # step exactly for a while (the optimizer's clip-miss back-off)
        elif reason is None and self.max_grad_norm is not None:
            coef = self._predict_clip_coef()
            if coef is None:
                reason = "clip_may_bind"
        if reason is None and self._span_mode:
            self._span_snapshot()
        elif reason is None and self.rollback == "auto" and not self._ensure_snapshot():
            reason = "snapshot_auto_pipeline_off"
        if reason is not None:
            self._deferred[reason] += 1
            return False
        self._snapshot.wait()
        self._counters["pipelined_steps"] += 1
        self._coef_pred = self._pipeline.grad_scale = coef
        return True

    def _predict_clip_coef(self) -> float | None:
        """Clip coefficient for the hooks of this window, or None to defer the window to ``step()``.

        1.0 when the norm history says clipping cannot bind (``clip_headroom`` margin); with
        ``clip_prediction="scale"``, otherwise ``max_grad_norm / last true norm`` (capped at 1).
        """
        if not self._norm_history:
            return None
        if self.clip_headroom * max(self._norm_history) + CLIP_EPS <= self.max_grad_norm:
            return 1.0
        if self.clip_prediction != "scale":
            return None
        return min(1.0, self.max_grad_norm / (self._norm_history[-1] + CLIP_EPS))

    def stats(self) -> dict[str, Any]:
        """Counters for logging (plain Python numbers; reading them never syncs the device)."""
        c = self._counters
        return {
            "steps": c["steps"],
            "skipped": c["skipped"],
            "consecutive_skips": len(self._streak.run),
            "rollbacks": c["rollbacks"],
            "pipeline_enabled": self.pipeline_enabled,
            "pipelined_steps": c["pipelined_steps"],
            "deferred_steps": dict(self._deferred),
            "clip_checks": c["clip_checks"],
            "clip_misses": c["clip_misses"],
            "clip_coef_predicted": self._last_coef[0],
            "clip_coef_true": self._last_coef[1],
            "last_grad_norm": self._norm_history[-1] if self._norm_history else None,
            "hook_seconds": self._pipeline.hook_seconds if self._pipeline is not None else 0.0,
            "pipeline_buckets": len(self._pipeline.buckets) if self._pipeline is not None else 0,
            "early_buckets": sum(b.early for b in self._pipeline.buckets)
            if self._pipeline is not None
            else 0,
            "hook_bucket_steps": self._pipeline.hook_bucket_steps if self._pipeline is not None else 0,
            "bucket_steps": self._pipeline.bucket_steps if self._pipeline is not None else 0,
            "verify_seconds": self._seconds["verify"],
            "rollback_seconds": self._seconds["rollback"],
            "snapshots": self._snapshot.count,
            "snapshot_seconds": self._snapshot.seconds,
            "snapshot_bytes": self._snapshot.nbytes,
            "snapshot_fallbacks": c["snapshot_fallbacks"],
        }


def snapshot_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Device bytes a snapshot of ``params`` and their optimizer state needs, plus the live state not
    allocated yet (optimizers create it at their first step): Adam-style groups (``betas``) get two
    moments per parameter, momentum groups one, at the parameter's element size (1 byte for the
    bitsandbytes 8-bit optimizers)."""
    eight_bit = "8bit" in type(optimizer).__name__.lower()
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
