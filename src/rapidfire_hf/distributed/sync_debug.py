"""Cross-rank synchronisation checks (``RAPIDFIRE_SYNC_DEBUG=1``).

Data-parallel replicas must hold the same parameters, and after the gradient all-reduce the same
gradients. A rank that drifts (a skipped all-reduce, a step taken alone, a non-deterministic kernel
in a replicated path) trains silently wrong. Every ``interval`` optimizer steps the checker reduces
each tensor to a few float64 checksums, all-gathers them (``world_size x num_tensors x 3`` numbers,
never the tensors themselves) and reports the largest relative difference as ``gradient_sync_diff``,
naming the tensors above ``threshold``.

Use it from any loop with :class:`SyncChecker`, or from a ``transformers``/rapidfire trainer with
:class:`SyncDebugCallback` (:func:`attach_sync_debug` adds it when the environment asks for it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

ENV_FLAG = "RAPIDFIRE_SYNC_DEBUG"
ENV_THRESHOLD = "RAPIDFIRE_SYNC_THRESHOLD"
ENV_INTERVAL = "RAPIDFIRE_SYNC_INTERVAL"
# Replicas under DDP receive bit-identical all-reduce results, so any difference is a bug; the
# default leaves room only for float64 rounding of the checksums themselves.
DEFAULT_THRESHOLD = 1e-9
_TRUE = {"1", "true", "yes", "on"}


def sync_debug_enabled() -> bool:
    """Whether ``RAPIDFIRE_SYNC_DEBUG`` asks for cross-rank checks."""
    return os.environ.get(ENV_FLAG, "").strip().lower() in _TRUE


@dataclass
class SyncReport:
    """Result of one cross-rank comparison (identical on every rank).

    Attributes:
        step: the optimizer step the check ran at.
        gradient_sync_diff: largest relative checksum difference over every compared tensor.
        param_diff: the same over parameters only.
        grad_diff: the same over gradients only (0.0 when no gradient was compared).
        mismatches: ``(name, kind, diff)`` for tensors whose difference passes the threshold, largest
            first; ``kind`` is ``"param"`` or ``"grad"``; ``name`` without wrapper prefixes.
        compared: number of tensors compared.
        skipped: names of sharded tensors that have no replicas to compare (ZeRO-3, FSDP2).
    """

    step: int
    gradient_sync_diff: float
    param_diff: float
    grad_diff: float
    mismatches: list[tuple[str, str, float]] = field(default_factory=list)
    compared: int = 0
    skipped: list[str] = field(default_factory=list)

    @property
    def in_sync(self) -> bool:
        return not self.mismatches

    def metrics(self) -> dict[str, float]:
        """The numbers to log (``gradient_sync_diff`` plus the split and the mismatch count)."""
        return {
            "gradient_sync_diff": self.gradient_sync_diff,
            "sync/param_diff": self.param_diff,
            "sync/grad_diff": self.grad_diff,
            "sync/mismatched_tensors": float(len(self.mismatches)),
        }


def _strip(name: str) -> str:
    # DDP adds "module.", torch.compile "_orig_mod.": neither is part of the user's parameter name
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def _is_sharded(p: torch.Tensor) -> bool:
    """Parameters that each rank holds a different piece of (no replica to compare against)."""
    if hasattr(p, "ds_id"):  # DeepSpeed ZeRO-3 partitioned parameter
        return True
    placements = getattr(p, "placements", None)  # FSDP2 DTensor
    return placements is not None and any(pl.is_shard() for pl in placements)


def tensor_checksums(t: torch.Tensor) -> torch.Tensor:
    """``[sum, position-weighted sum, sum of |x|]`` in float64.

    The weighted sum catches two entries swapping places, which a plain sum misses; ``sum |x|`` is
    the scale the differences are divided by.
    """
    x = t.detach().reshape(-1).to(torch.float64)
    weights = 1.0 + (torch.arange(x.numel(), device=x.device, dtype=torch.float64) % 97) / 97.0
    return torch.stack([x.sum(), (x * weights).sum(), x.abs().sum()])


def _collect(
    model: torch.nn.Module, grads: bool
) -> tuple[list[str], list[str], list[torch.Tensor], list[str]]:
    names, kinds, sums, skipped = [], [], [], []
    for name, p in model.named_parameters():
        name = _strip(name)
        if _is_sharded(p):
            skipped.append(name)
            continue
        names.append(name)
        kinds.append("param")
        sums.append(tensor_checksums(p))
        if grads and p.grad is not None:
            names.append(name)
            kinds.append("grad")
            sums.append(tensor_checksums(p.grad))
    return names, kinds, sums, skipped


def check_sync(
    model: torch.nn.Module,
    step: int = 0,
    threshold: float = DEFAULT_THRESHOLD,
    grads: bool = True,
    group=None,
) -> SyncReport:
    """Compare parameter (and gradient) checksums of ``model`` across ranks. A collective: every rank
    of ``group`` must call it at the same point.

    Gradients are compared when they exist on every rank (a tensor with a gradient on one rank only
    is reported as a mismatch of kind ``"grad"``).

    Args:
        model: the (possibly DDP-wrapped) model.
        step: the step number to put in the report.
        threshold: largest healthy relative difference ``|c_rank - c_0| / (sum|x|_0 + 1e-30)``.
        grads: also compare ``.grad`` where it exists.
        group: process group (default: the world).

    Returns:
        A :class:`SyncReport`, identical on every rank. Single process: all zeros.
    """
    names, kinds, sums, skipped = _collect(model, grads)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1 or not sums:
        return SyncReport(step, 0.0, 0.0, 0.0, compared=len(sums), skipped=skipped)
    world = dist.get_world_size(group)
    # The tensor lists must line up across ranks; a gradient present on only some ranks would shift
    # them, so agree first on which gradients every rank has.
    local = torch.stack(sums)  # [N, 3] on the parameters' device (NCCL needs it there)
    count = torch.tensor([local.shape[0]], device=local.device, dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    if len({int(c) for c in counts}) > 1:
        return _count_mismatch(model, step, threshold, group, skipped)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    stacked = torch.stack(gathered).cpu()  # [world, N, 3]: the one host read of the check
    ref = stacked[0]
    diff = ((stacked[:, :, :2] - ref[:, :2]).abs().amax(dim=(0, 2)) / (ref[:, 2] + 1e-30)).tolist()
    return _report(step, names, kinds, diff, threshold, skipped)


def _count_mismatch(model, step, threshold, group, skipped) -> SyncReport:
    """Ranks disagree on which gradients exist: compare parameters only, and name the gradients."""
    report = check_sync(model, step, threshold, grads=False, group=group)
    have = torch.tensor(
        [float(p.grad is not None) for _, p in model.named_parameters() if not _is_sharded(p)],
        device=next(model.parameters()).device,
    )
    low, high = have.clone(), have.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    names = [_strip(n) for n, p in model.named_parameters() if not _is_sharded(p)]
    odd = [(n, "grad", float("inf")) for n, lo, hi in zip(names, low.tolist(), high.tolist()) if lo != hi]
    report.mismatches = odd + report.mismatches
    report.grad_diff = report.gradient_sync_diff = float("inf")
    return report


def _report(step, names, kinds, diff, threshold, skipped) -> SyncReport:
    def worst(kind):
        values = [d for d, k in zip(diff, kinds) if k == kind]
        return max(values) if values else 0.0

    bad = sorted(
        ((n, k, d) for n, k, d in zip(names, kinds, diff) if not d <= threshold),  # NaN counts as bad
        key=lambda item: -item[2] if item[2] == item[2] else float("-inf"),
    )
    p, g = worst("param"), worst("grad")
    return SyncReport(step, max(p, g), p, g, bad, compared=len(names), skipped=skipped)


class SyncChecker:
    """Run :func:`check_sync` every ``interval`` steps from any training loop.

    Args:
        model: the model to check (DDP-wrapped or not).
        interval: optimizer steps between checks (``gradient.sync_interval`` of the rapidfire config).
        threshold: largest healthy relative difference.
        raise_on_mismatch: raise ``RuntimeError`` instead of logging an error.

    Example:
        >>> checker = SyncChecker(model, interval=4)
        >>> for step, batch in enumerate(loader):
        ...     accelerator.backward(model(batch).loss)
        ...     checker.maybe_check(step, grads=True)   # after backward: gradients are compared too
        ...     optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        interval: int = 1,
        threshold: float = DEFAULT_THRESHOLD,
        raise_on_mismatch: bool = False,
    ):
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval={interval!r}: must be an int >= 1 (optimizer steps between checks)")
        self.model = model
        self.interval = interval
        self.threshold = threshold
        self.raise_on_mismatch = raise_on_mismatch
        self.reports: list[SyncReport] = []

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def maybe_check(self, step: int, grads: bool = True) -> SyncReport | None:
        """Check when ``step`` is a multiple of ``interval``; same ``step`` on every rank."""
        return self.check(step, grads) if self.due(step) else None

    def check(self, step: int, grads: bool = True) -> SyncReport:
        report = check_sync(self.model, step, self.threshold, grads)
        self.reports.append(report)
        if not report.in_sync:
            listed = ", ".join(f"{n} ({k}, {d:.3g})" for n, k, d in report.mismatches[:10])
            message = (
                f"rapidfire sync debug: ranks disagree at step {step}: gradient_sync_diff="
                f"{report.gradient_sync_diff:.3g} > {self.threshold:g} in {len(report.mismatches)} tensor(s): "
                f"{listed}"
            )
            if self.raise_on_mismatch:
                raise RuntimeError(message)
            logger.error(message)
        return report


class SyncDebugCallback(TrainerCallback):
    """A ``TrainerCallback`` running :class:`SyncChecker` on the trained model.

    Gradients are compared at ``on_pre_optimizer_step`` (reduced, not yet applied) and parameters
    after the step, every ``interval`` optimizer steps; the latest numbers are added to the next
    ``on_log`` (insert this callback first so that loggers see them: :func:`attach_sync_debug`).

    Args:
        interval: optimizer steps between checks (default: ``RAPIDFIRE_SYNC_INTERVAL`` or 1).
        threshold: largest healthy difference (default: ``RAPIDFIRE_SYNC_THRESHOLD`` or 1e-9).
        model: the model to check (default: the ``model`` the trainer passes to callbacks).
        raise_on_mismatch: stop the run with ``RuntimeError`` on a mismatch.
    """

    def __init__(
        self,
        interval: int | None = None,
        threshold: float | None = None,
        model=None,
        raise_on_mismatch: bool = False,
    ):
        self.interval = interval or int(os.environ.get(ENV_INTERVAL, "1"))
        self.threshold = (
            threshold if threshold is not None else float(os.environ.get(ENV_THRESHOLD, DEFAULT_THRESHOLD))
        )
        self.model = model
        self.raise_on_mismatch = raise_on_mismatch
        self.optimizer_steps = 0
        self.checker: SyncChecker | None = None
        self.last: SyncReport | None = None

    def _checker(self, model) -> SyncChecker:
        if self.checker is None:
            self.checker = SyncChecker(
                self.model or model, self.interval, self.threshold, self.raise_on_mismatch
            )
        return self.checker

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        checker = self._checker(model)
        if checker.due(self.optimizer_steps):
            self.last = checker.check(self.optimizer_steps, grads=True)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        checker = self._checker(model)
        if checker.due(self.optimizer_steps):
            after = checker.check(self.optimizer_steps, grads=False)
            self.last = _merge(self.last, after)
        self.optimizer_steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.last is None or logs is None:
            return
        logs.update(self.last.metrics())
        if state.log_history:
            state.log_history[-1].update(self.last.metrics())


def _merge(before: SyncReport | None, after: SyncReport) -> SyncReport:
    """Gradients from the pre-step check, parameters from the post-step check."""
    if before is None or before.step != after.step:
        return after
    return SyncReport(
        after.step,
        max(before.grad_diff, after.param_diff),
        after.param_diff,
        before.grad_diff,
        [m for m in before.mismatches if m[1] == "grad"] + after.mismatches,
        before.compared,
        after.skipped,
    )


def attach_sync_debug(trainer, interval: int | None = None, force: bool = False) -> SyncDebugCallback | None:
    """Add a :class:`SyncDebugCallback` first in ``trainer``'s callbacks when ``RAPIDFIRE_SYNC_DEBUG=1``.

    Works with ``transformers.Trainer``, TRL trainers and ``rapidfire_hf.PPOTrainer`` (anything with a
    ``callback_handler``). ``interval`` defaults to the trainer's ``rf_config.gradient.sync_interval``.

    Args:
        trainer: the trainer.
        interval: optimizer steps between checks.
        force: attach even when the environment variable is not set.

    Returns:
        The callback, or None when not attached.
    """
    if not (force or sync_debug_enabled()):
        return None
    if interval is None:
        rf = getattr(trainer, "rf_config", None)
        interval = getattr(getattr(rf, "gradient", None), "sync_interval", None)
    callback = SyncDebugCallback(interval=interval)
    trainer.callback_handler.callbacks.insert(0, callback)  # before loggers, so on_log reaches them
    return callback
