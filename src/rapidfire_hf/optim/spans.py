"""Verification every ``sync_interval`` steps: the span half of RapidFireOptimizer.

With ``sync_interval=N > 1`` (and ``rollback="auto"``) the optimizer applies every step of a span of
N steps without reading anything on the host: each step's health flags, clip-prediction check and
gradient norm stay on the device. At the span's last step they are packed into one small tensor and
read once: on CUDA with a non-blocking copy into pinned memory and an event, consumed at the next
point where the verdict matters (the first update of the next window: its first closing hook, or its
``step()``), so the GPU never waits for the host; on the CPU at once, unless ``async_verify=True``.

A span that fails is undone as a whole: the snapshot taken at its first step (a verified boundary)
is restored. ``opt.last_rollback`` then lists the undone steps (:class:`Rollback`): the first failed
one is skipped (or replayed, when only its clip prediction missed), the others are to be replayed by
the caller with the same data, in order, so the run equals one that verified every step and skipped
only the bad batch. When the verdict arrives during the next window, that window's gradients came from
weights now undone: the window is discarded and listed for replay too. :meth:`verify_now` closes the
span early (call it before saving or at the end of training; PPOTrainer does so after each update).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from rapidfire_hf.optim.health import OptimizerEvent
from rapidfire_hf.optim.verification import CLIP_EPS

CLIP_ONLY = ["clip_prediction"]


@dataclass
class Rollback:
    """What one rollback undid.

    Attributes:
        steps: the optimizer steps (indices as in ``OptimizerEvent.step``) whose updates were undone.
        failed: step -> names of the rules it failed (the step that caused the rollback).
        replay: the steps whose batches the caller should run again, in this order (healthy steps of
            the span, steps after the failure, a discarded window, a missed clip prediction).
    """

    steps: list[int]
    failed: dict[int, list[str]] = field(default_factory=dict)
    replay: list[int] = field(default_factory=list)


@dataclass
class _Record:
    step: int
    names: list[str]
    flags: list[torch.Tensor]
    norm: torch.Tensor | None
    metrics: dict


class _Verdict:
    """The packed flags of a closed span, on their way to the host."""

    def __init__(self, records: list[_Record], packed: torch.Tensor, non_blocking: bool):
        self.records = records
        self.event = None
        if non_blocking and packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()  # recorded a window ago: normally long complete
        return self.host.tolist()


class SpanMixin:
    """``sync_interval`` spans: apply unverified, verify N steps with one read, undo a failed span."""

    @property
    def _span_mode(self) -> bool:
        """Spans of ``sync_interval`` steps; with ``sync_interval=1`` only when ``async_verify=True``
        (each step then applied before its verdict, which arrives at the next window)."""
        return self.rollback == "auto" and (self.sync_interval > 1 or self.async_verify is True)

    def _span_snapshot(self) -> None:
        """Before the first update of a span: snapshot every parameter and its state (a verified state)."""
        if not self._span_snapshot_valid:
            self._snapshot.capture(self._params, self._inner, self._counters["steps"])
            self._snapshot_params = self._params
            self._span_snapshot_valid = True
        self._snapshot.wait()

    def _span_step(self, inner: torch.optim.Optimizer) -> None:
        """``step()`` in span mode: apply this window's update unverified and record its flags."""
        if self._verdict is not None:  # the last span's verdict, before anything of this window is applied
            self._resolve(mid_window=True)
        step = self._counters["steps"]
        if self._discard:  # this window's gradients came from weights the verdict undid
            self._discard = False
            self._snapshot.restore(self._snapshot_params, self._inner)  # not during backward: here
            self._report.steps.append(step)
            self._report.replay.append(step)
            self.last_step_skipped = True
            self._counters["discarded"] += 1
            return
        pipeline = self._pipeline
        pipelined = pipeline is not None and pipeline.window_pipelined
        params = self._params
        flags, true = {}, None
        if pipelined:
            pipeline.join()
            pipeline.record_norms(pipeline.leftovers(params))
            norms = pipeline.ordered_norms()
            total = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
        else:
            grads = [p.grad for p in params if p.grad is not None]
            total = get_total_norm(grads) if grads else None
        if self.max_grad_norm is not None and total is not None:
            true = torch.clamp(self.max_grad_norm / (total + CLIP_EPS), max=1.0)
            if pipelined:
                if self.clip_prediction == "scale":
                    ok = (self._coef_pred - true).abs() <= self.clip_tolerance * true
                else:
                    ok = total + CLIP_EPS <= self.max_grad_norm
                flags["clip_prediction"] = ok
                self._counters["clip_checks"] += 1
        metrics = self._health.metrics(total)
        flags = {**self._health.flags(metrics), **flags}
        if pipelined:
            pipeline.step_leftovers(params, true)
        else:
            self._span_snapshot()
            if true is not None:
                clip_grads_with_norm_(params, self.max_grad_norm, total)
            inner.step()
        names = list(flags)
        self._span.append(_Record(step, names, [flags[n].float().reshape(()) for n in names], total, metrics))
        if len(self._span) >= self.sync_interval:
            self._close_span(non_blocking=self._async_verify())

    def _async_verify(self) -> bool:
        if self.async_verify is not None:
            return self.async_verify
        return any(p.is_cuda for p in self._params[:1])

    def _close_span(self, non_blocking: bool) -> None:
        """Pack the span's flags and norms into one tensor and start reading it (one read per span)."""
        records, self._span = self._span, []
        if not records:
            return
        parts = []
        for r in records:
            norm = r.norm.detach().float().reshape(()) if r.norm is not None else torch.zeros(())
            parts.extend(r.flags + [norm.to(r.flags[0].device if r.flags else norm.device)])
        device = parts[0].device
        packed = torch.stack([t.to(device) for t in parts])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            mask = torch.tensor([i for r in records for i in [True] * len(r.flags) + [False]], device=device)
            verdict = torch.where(mask, packed, torch.ones_like(packed))
            torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
            packed = torch.where(mask, verdict, packed)
        self._verdict = _Verdict(records, packed, non_blocking)
        if not non_blocking:
            self._resolve(mid_window=False)

    def verify_now(self) -> Rollback | None:
        """Verify the steps applied since the last verified boundary now (one host read) and undo them if
        one failed. Returns (and sets ``last_rollback`` to) what was undone, or None."""
        self._join()
        self._close_span(non_blocking=False)
        if self._verdict is not None:
            self._resolve(mid_window=False)
        report, self._report = (self._report if self._report.steps else None), Rollback([])
        self.last_rollback = report
        return report

    def _resolve(self, mid_window: bool) -> None:
        """Read the pending verdict; keep the span, or restore its snapshot and record what to replay.

        ``mid_window``: the verdict arrives after the current window's forward (in its first closing
        hook, or in its ``step()``): that window is discarded, and the snapshot is restored in its
        ``step()``, after backward (autograd still needs the weights it saved)."""
        verdict, self._verdict = self._verdict, None
        values = verdict.values()
        at, first_bad, results = 0, None, []
        for r in verdict.records:
            row = values[at : at + len(r.names) + 1]
            at += len(r.names) + 1
            failed = [n for n, ok in zip(r.names, row) if ok < 0.5]
            results.append((r, failed, row[-1] if r.norm is not None else None))
            if failed and first_bad is None:
                first_bad = len(results) - 1
        if first_bad is None:
            for r, _, norm in results:
                self._after_healthy(r.metrics, [norm] if norm is not None else [])
            self._span_snapshot_valid = False  # the state moved on: the next span snapshots afresh
            return
        if not mid_window:
            self._snapshot.restore(self._snapshot_params, self._inner)
        self._counters["rollbacks"] += 1
        bad, failed, norm = results[first_bad]
        report = self._report
        report.steps.extend(r.step for r, _, _ in results)
        report.failed[bad.step] = failed
        clip_only = failed == CLIP_ONLY
        report.replay.extend(r.step for i, (r, _, _) in enumerate(results) if i != first_bad or clip_only)
        if "clip_prediction" in failed:
            self._counters["clip_misses"] += 1
        if norm is not None:
            self._remember_norm(norm)
        self._counters["skipped"] += 1
        details = {"grad_norm": norm, "steps_lost": len(results) - 1}
        if "loss" in bad.metrics:
            details["loss"] = float(bad.metrics["loss"])
        self.events.append(OptimizerEvent(bad.step, "rollback", failed, details))
        self._health.update_stats(bad.metrics, failed)
        if not clip_only:
            self._streak.skipped(bad.step, failed, details)
        self.last_step_skipped = True
        self._discard = mid_window
