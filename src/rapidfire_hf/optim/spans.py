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

:class:`Span` owns the unverified steps and the verdict on its way; the optimizer applies the steps and
acts on what :meth:`Span.read` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

if TYPE_CHECKING:  # the verifier imports Rollback from here
    from rapidfire_hf.optim.pipeline import GradientPipeline
    from rapidfire_hf.optim.verification import Verifier


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


@dataclass
class SpanVerdict:
    """A span's verdict on the host.

    Attributes:
        results: per step of the span, in order: its record, the rules it failed, its host gradient norm.
        first_bad: index in ``results`` of the first step that failed a rule, or None (all healthy).
    """

    results: list[tuple[_Record, list[str], float | None]]
    first_bad: int | None


class Span:
    """``sync_interval`` steps applied unverified and verified with one read.

    Args:
        interval: steps per span (``sync_interval``).
        async_verify: read the verdict with a non-blocking copy consumed at the next window (None: on
            CUDA, for ``interval > 1``).
        checks: health rules are checked at all (``rollback="auto"``); without them there are no spans.
        verifier: what turns a span's flags into skips, events and the rollback report; its clip predictor
            and rollback point are the ones the span's steps use.
    """

    def __init__(self, interval: int, async_verify: bool | None, checks: bool, verifier: Verifier):
        self.interval = interval
        self.async_verify = async_verify
        self.active = checks and (interval > 1 or async_verify is True)
        self.verifier = verifier
        self.records: list[_Record] = []  # unverified steps of the current span
        self.verdict: _Verdict | None = None  # a closed span's flags on their way to the host
        self.discard = False  # the current window's gradients came from weights the verdict undid

    def step(self, inner: torch.optim.Optimizer, pipeline: GradientPipeline | None, params: list) -> None:
        """``step()`` in span mode: apply this window's update unverified and record its flags."""
        verifier, clip, point = self.verifier, self.verifier.clip, self.verifier.point
        if self.verdict is not None:  # the last span's verdict, before anything of this window is applied
            self.resolve(mid_window=True, inner=inner)
        if self.discard:  # this window's gradients came from weights the verdict undid
            self.discard = False
            point.restore(inner)  # not during backward: here
            verifier.discarded()
            return
        pipelined = pipeline is not None and pipeline.window_pipelined
        flags, true = {}, None
        if pipelined:
            total = pipeline.window_norm(params, record=True)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            total = get_total_norm(grads) if grads else None
        if clip.max_norm is not None and total is not None:
            true = clip.true_coef(total)
            if pipelined:
                flags["clip_prediction"] = clip.check(total, true)
        metrics, health = verifier.flags(total)
        flags = {**health, **flags}
        if pipelined:
            pipeline.step_leftovers(params, true)
        else:
            point.ensure_span(params, inner, verifier.step)
            if true is not None:
                clip_grads_with_norm_(params, clip.max_norm, total)
            inner.step()
        if self.add(verifier.step, flags, total, metrics):
            self.close(self.non_blocking(params), inner)

    def verify_now(self, inner: torch.optim.Optimizer | None) -> Rollback | None:
        """Verify the steps applied since the last verified boundary (one host read), undo them if one
        failed; what was undone (also the verifier's ``last_rollback``), or None."""
        self.close(non_blocking=False, inner=inner)
        if self.verdict is not None:
            self.resolve(mid_window=False, inner=inner)
        return self.verifier.take_report()

    def resolve(self, mid_window: bool, inner: torch.optim.Optimizer) -> None:
        """Read the pending verdict; keep the span, or restore its snapshot and record what to replay.

        ``mid_window``: the verdict arrives after the current window's forward (in its first closing
        hook, or in its ``step()``): that window is discarded, and the snapshot is restored in its
        ``step()``, after backward (autograd still needs the weights it saved)."""
        verifier, clip, point = self.verifier, self.verifier.clip, self.verifier.point
        verdict = self.read()
        if verdict.first_bad is None:
            for r, _, norm in verdict.results:
                verifier.healthy(r.metrics, [norm] if norm is not None else [])
            point.span_verified()  # the state moved on: the next span snapshots afresh
            return
        if not mid_window:
            point.restore(inner)
        bad, failed, norm = verdict.results[verdict.first_bad]
        if "clip_prediction" in failed:
            clip.missed()
        if norm is not None:
            clip.remember(norm)
        verifier.span_failed([r.step for r, _, _ in verdict.results], bad.step, failed, bad.metrics, norm)
        self.discard = mid_window

    def non_blocking(self, params: list[torch.Tensor]) -> bool:
        """Whether a closed span is read without waiting (``async_verify``, else: on CUDA)."""
        if self.async_verify is not None:
            return self.async_verify
        return any(p.is_cuda for p in params[:1])

    def add(
        self, step: int, flags: dict[str, torch.Tensor], norm: torch.Tensor | None, metrics: dict
    ) -> bool:
        """Record an applied, unverified step; True when the span is full (close it)."""
        names = list(flags)
        self.records.append(
            _Record(step, names, [flags[n].float().reshape(()) for n in names], norm, metrics)
        )
        return len(self.records) >= self.interval

    def close(self, non_blocking: bool, inner: torch.optim.Optimizer | None) -> None:
        """Pack the span's flags and norms into one tensor and start reading it (one read per span); read
        at once unless ``non_blocking``."""
        records, self.records = self.records, []
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
        self.verdict = _Verdict(records, packed, non_blocking)
        if not non_blocking:
            self.resolve(mid_window=False, inner=inner)

    def read(self) -> SpanVerdict:
        """Take the pending verdict off the device (waits for it if it has not arrived)."""
        verdict, self.verdict = self.verdict, None
        values = verdict.values()
        at, first_bad, results = 0, None, []
        for r in verdict.records:
            row = values[at : at + len(r.names) + 1]
            at += len(r.names) + 1
            failed = [n for n, ok in zip(r.names, row) if ok < 0.5]
            results.append((r, failed, row[-1] if r.norm is not None else None))
            if failed and first_bad is None:
                first_bad = len(results) - 1
        return SpanVerdict(results, first_bad)

    def clear(self) -> None:
        """Forget unverified steps (the optimizer's state was replaced)."""
        self.records, self.verdict, self.discard = [], None, False
