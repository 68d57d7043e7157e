"""RapidFireOptimizer: an inner torch optimizer plus gradient pipeline, verification and exact rollback."""

from __future__ import annotations

import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from rapidfire_hf.optim.bnb import eight_bit_state
from rapidfire_hf.optim.clip import CLIP_BACKOFF_MAX, ClipPredictor
from rapidfire_hf.optim.health import HealthMonitor, Rule
from rapidfire_hf.optim.inner import build_inner, normalize_param_groups, resolve_inner_class
from rapidfire_hf.optim.options import check_options
from rapidfire_hf.optim.pipeline import NO_PIPELINE_STATS, GradientPipeline, accelerate_flag
from rapidfire_hf.optim.skips import SkipStreak
from rapidfire_hf.optim.snapshot import RollbackPoint
from rapidfire_hf.optim.spans import Rollback, Span
from rapidfire_hf.optim.verification import Verifier, device_snapshot_fits, warn_snapshot_fallback
from rapidfire_hf.utils.units import GIB

WINDOW_COUNTS = ("pipelined_steps", "snapshot_fallbacks")  # the counters the optimizer itself keeps


def full_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's global value as a plain tensor (a collective, no host sync); other tensors as they are."""
    to_full = getattr(t, "full_tensor", None)
    return to_full() if callable(to_full) else t


class RapidFireOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that wraps an inner optimizer and adds the gradient pipeline, predicted
    clipping, health verification and bit-exact rollback.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects, so LR schedulers,
    ``state_dict()``, ``accelerator.prepare`` and ``transformers.Trainer(optimizers=(opt, sched))`` see
    a normal optimizer.

    It is a composition, each part owning its state: the inner optimizer, a
    :class:`~rapidfire_hf.optim.pipeline.GradientPipeline`, a
    :class:`~rapidfire_hf.optim.verification.Verifier` (verdicts, skips, events, the rollback report), a
    :class:`~rapidfire_hf.optim.clip.ClipPredictor`, a :class:`~rapidfire_hf.optim.spans.Span`
    (``sync_interval``) and a :class:`~rapidfire_hf.optim.snapshot.RollbackPoint`. This class decides each
    window and tells them the outcome.

    Args:
        params: parameters or param-group dicts. Leave out to bind later with :meth:`bind` (a trainer
            does this for the model it trains).
        optimizer: ``"adamw"`` (torch AdamW, fused on CUDA, foreach elsewhere), ``"sgd"``,
            ``"adamw8bit"`` / ``"paged_adamw8bit"`` (bitsandbytes), a ``torch.optim.Optimizer`` subclass,
            or an optimizer instance (already holding its parameters).
        gradient_pipeline: step parameters during the backward that closes an accumulation window, a
            bucket at a time as their gradients complete, and free their gradients (see
            :mod:`rapidfire_hf.optim.pipeline` for how windows are found).
        pipeline_bucket_mb: MiB of gradient the pipeline steps at once: parameters of one param group
            are grouped, in the order their gradients become ready, into buckets of about this size,
            each stepped with one inner ``step()`` call (one multi-tensor kernel for foreach/fused
            AdamW). Larger buckets mean fewer calls but gradients held a little longer; ``0`` steps each
            parameter on its own. The result is the same for any size.
        pipeline_overlap: on CUDA, the share (0 to 1; True = 1) of the gradient bytes, in the order
            gradients complete, whose bucket steps run on a side stream next to the rest of backward
            instead of after it in the same stream; above 0 a device snapshot is copied on that
            stream too, next to the following forward. ``step()`` joins the streams. The arithmetic
            is the same, so is the result. No effect on the CPU.
        pipeline_share: share (0 to 1) of the closing window's gradient bytes, first buckets of backward
            first, stepped inside backward (config ``gradient.overlap_factor``). The other buckets keep
            their gradients until ``step()``, which steps them once the window is verified (with the
            true clip coefficient): they need no rollback snapshot, so the snapshot holds only the
            parameters (and state) of the early buckets, and a failed window leaves them untouched. 1 (the
            default) steps every bucket in backward, 0 none (no window is pipelined then).
        pipeline_depth: at most this many buckets stepped inside backward per window, ahead of
            verification (config ``gradient.pipeline_depth``; None: no limit); the rest wait for ``step()``
            as with ``pipeline_share``.
        side_stream_depth: with ``pipeline_overlap``, bucket steps that may be queued on the side stream
            before backward waits for them on the device (None: until ``step()``).
        accumulation_steps: backwards per window when not under accelerate (default: 1, or accelerate's
            ``sync_gradients`` when an ``Accelerator`` exists).
        max_grad_norm: clip the global L2 gradient norm to this value (like ``clip_grad_norm_``).
            With the pipeline, windows where the norm history says clipping could bind are stepped in
            ``step()`` with the exact coefficient; the others are stepped in the hooks with coefficient
            1, and a miss (the true norm needed clipping) is rolled back when ``rollback="auto"``.
        rollback: ``"auto"`` (the default) checks every step (finite loss and gradients, gradient-norm
            and loss z-scores, user rules) and skips unhealthy batches, restoring a snapshot when the
            update was already applied by the pipeline, so a NaN loss never reaches the weights;
            ``"off"`` checks nothing (a non-finite gradient is applied as it is).
        snapshot: where the rollback snapshot lives: ``"device"``, ``"host"`` (pinned memory) or
            ``"auto"`` (the default: the device when the snapshot and the optimizer state still to be
            allocated fit in 60% of the free GPU memory; otherwise the gradient pipeline is turned off,
            with a warning and a ``snapshot_auto_pipeline_off`` event, since rollback then needs no
            snapshot: each update is verified before it is applied).
        snapshot_interval: verified steps between snapshots; above 1 a rollback also undoes the good
            steps since the last snapshot (reported in the event as ``steps_lost``).
        sync_interval: steps verified together with one host read (config ``gradient.sync_interval``;
            needs ``rollback="auto"``). Above 1, each step is applied at once and its health flags stay on
            the device; every ``sync_interval`` steps they are read together (on CUDA asynchronously,
            consumed at the next window) and a failure restores the snapshot taken at the span's start.
            ``last_rollback`` then lists what was undone and which steps the caller must replay (see
            :mod:`rapidfire_hf.optim.spans`); call :meth:`verify_now` before saving or stopping.
        async_verify: read a span's verdict with a non-blocking copy consumed at the next window (None:
            on CUDA, for ``sync_interval > 1``; True: always, and with ``sync_interval=1`` every step is
            then applied before its verdict, a snapshot taken before each, and a failure undoes it and
            the window after it, both listed in ``last_rollback``; False: read at the span's end).
        grad_z_threshold: largest healthy z-score of the gradient norm.
        loss_z_threshold: largest healthy z-score of the observed loss (see :meth:`observe_loss`).
        warmup_steps: verified steps during which the z-score rules compare a value with the typical
            magnitude of the history (a 1000x spike fails from the second step on) instead of its
            spread (median and MAD of the last 32 values, see :class:`~rapidfire_hf.optim.health.RobustStat`).
        max_consecutive_skips: skipped steps in a row after which ``step()`` raises
            :class:`~rapidfire_hf.optim.skips.ConsecutiveSkipsError`, naming what failed and the setting
            to check (None: never). Every skip is logged as a warning with its step. Windows undone for a
            missed clip prediction (replayed by the caller) do not count.
        clip_headroom: the pipeline steps in the hooks with coefficient 1 only when
            ``headroom * max(recent norms)`` stays below ``max_grad_norm``.
        clip_prediction: what the pipeline does in windows where clipping may bind. None (the default):
            ``"exact"``: in a plain loop nothing replays a window whose prediction missed, so predicting
            would drop a healthy batch (and under PPOTrainer a miss costs the whole window again, while
            the overlap gains at most one optimizer step). ``"exact"`` defers
            them to ``step()`` (the update is exactly ``clip_grad_norm_``'s). ``"scale"`` steps them in
            the hooks too, with the coefficient predicted from the last window's true norm
            (``max_grad_norm / last_norm``), and checks after backward that it lies within
            ``clip_tolerance`` (relative) of the true coefficient; a miss is rolled back and the window
            skipped (PPOTrainer replays it; a plain loop must replay ``last_rollback.replay`` itself, and a
            ``UserWarning`` says so at the first miss). The accepted update then differs from exact clipping by at
            most that tolerance in scale, which Adam-type optimizers largely absorb (their step is
            nearly invariant to the gradient's scale). Needs ``max_grad_norm`` and ``rollback="auto"``.
        clip_tolerance: largest accepted ``|predicted - true| / true`` clip coefficient (``"scale"``).
        clip_backoff: after a missed clip prediction the next window is stepped exactly (deferred to
            ``step()``), after each further miss twice as many, up to ``clip_backoff`` windows (0: never
            back off). Measured on the CPU demo (``rapidfire demo --config aggressive``): without it a
            quarter of the windows missed, each rolled back and replayed: 0.13x the speed of no config.
        enable_fused_kernels: True forces the fused kernel, False the single-tensor loop, None picks.
        enable_fused_kernels: also, passed to a ``PPOTrainer``, ``True`` switches on the trainer's Liger
            kernels when liger-kernel is installed and the device is CUDA (a log line says what was enabled).
        precision: ``"bf16"`` or ``"fp16"``: the mixed precision a ``PPOTrainer`` given this optimizer runs
            (fp16 with dynamic loss scaling through accelerate). The optimizer itself steps each parameter in
            its own dtype; in a plain loop, run the forward under ``torch.autocast`` and, for fp16, step
            through ``torch.amp.GradScaler``: ``scaler.scale(loss).backward(); scaler.step(opt);
            scaler.update()`` (the scaler unscales the inner optimizer's groups and skips overflowing
            steps). fp16 cannot be combined with ``gradient_pipeline`` (the hooks would step scaled
            gradients).
        **inner_kwargs: hyper-parameters of the inner optimizer (``lr``, ``betas``, ``weight_decay``,
            ``momentum``, ...), checked against its signature at construction.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = RapidFireOptimizer(model.parameters(), lr=1e-3, gradient_pipeline=True, rollback="auto")
        >>> loss = model(torch.randn(8, 4)).pow(2).mean()
        >>> opt.observe_loss(loss)
        >>> loss.backward()   # parameters are stepped here, a bucket at a time, as gradients complete
        >>> opt.step()        # verifies; rolls back and skips the batch if a rule failed
        >>> opt.zero_grad()
        >>> opt.stats()["steps"]
        1
    """

    def __init__(
        self,
        params: Iterable | None = None,
        *,
        optimizer: str | type | torch.optim.Optimizer = "adamw",
        gradient_pipeline: bool = False,
        pipeline_bucket_mb: float = 256.0,
        pipeline_overlap: float = 0.0,
        pipeline_share: float = 1.0,
        pipeline_depth: int | None = None,
        side_stream_depth: int | None = None,
        accumulation_steps: int | None = None,
        max_grad_norm: float | None = None,
        rollback: str = "auto",
        snapshot: str = "auto",
        snapshot_interval: int = 1,
        sync_interval: int = 1,
        async_verify: bool | None = None,
        grad_z_threshold: float = 6.0,
        loss_z_threshold: float = 6.0,
        warmup_steps: int = 10,
        max_consecutive_skips: int | None = 10,
        clip_headroom: float = 2.0,
        clip_prediction: str | None = None,
        clip_tolerance: float = 0.05,
        clip_backoff: int = CLIP_BACKOFF_MAX,
        enable_fused_kernels: bool | None = None,
        precision: str | None = None,
        **inner_kwargs: Any,
    ):
        checked = check_options(
            params=params,
            optimizer=optimizer,
            inner_kwargs=inner_kwargs,
            precision=precision,
            gradient_pipeline=gradient_pipeline,
            rollback=rollback,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            snapshot=snapshot,
            snapshot_interval=snapshot_interval,
            sync_interval=sync_interval,
            grad_z_threshold=grad_z_threshold,
            loss_z_threshold=loss_z_threshold,
            clip_headroom=clip_headroom,
            warmup_steps=warmup_steps,
            max_consecutive_skips=max_consecutive_skips,
            clip_prediction=clip_prediction,
            clip_tolerance=clip_tolerance,
            pipeline_bucket_mb=pipeline_bucket_mb,
            pipeline_overlap=pipeline_overlap,
            pipeline_share=pipeline_share,
            pipeline_depth=pipeline_depth,
            side_stream_depth=side_stream_depth,
            enable_fused_kernels=enable_fused_kernels,
        )
        self.precision = precision
        self.pipeline_bucket_mb = checked["pipeline_bucket_mb"]
        self.pipeline_overlap = checked["pipeline_overlap"]
        self.pipeline_share = checked["pipeline_share"]
        self.pipeline_depth = checked["pipeline_depth"]
        self.side_stream_depth = side_stream_depth
        self.accumulation_steps = accumulation_steps
        self.rollback = rollback
        self.defaults_taken: dict[str, Any] = {}  # what bind() took from a trainer's defaults
        self._spec = optimizer
        self._inner_kwargs = dict(inner_kwargs)
        self._fused = enable_fused_kernels
        self._want_pipeline = gradient_pipeline
        checks = rollback == "auto"
        # the parts, each owning its state (their modules say what they do)
        self._clip = ClipPredictor(
            max_grad_norm, clip_headroom, checked["clip_prediction"], clip_tolerance, clip_backoff
        )
        self._rollback_point = RollbackPoint(snapshot, snapshot_interval)
        self._verifier = Verifier(
            checks,
            HealthMonitor(grad_z_threshold, loss_z_threshold, warmup_steps),
            SkipStreak(max_consecutive_skips, "RapidFireOptimizer"),
            self._clip,
            self._rollback_point,
        )
        self._span = Span(sync_interval, async_verify, checks, self._verifier)
        self._inner: torch.optim.Optimizer | None = None
        self._pipeline: GradientPipeline | None = None
        self._windows: Counter = Counter()  # WINDOW_COUNTS
        self._deferred: Counter = Counter()  # windows deferred to step(), by reason
        # torch.optim.Optimizer's step hooks, honoured in step()
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        if isinstance(optimizer, torch.optim.Optimizer):
            self._attach(optimizer)
        elif params is not None:
            self.bind(params)

    # ---- settings and results, read from the parts that hold them ------------------------------------
    max_grad_norm = property(lambda self: self._clip.max_norm, doc="None: no clipping; set_max_grad_norm")
    clip_prediction = property(lambda self: self._clip.mode)
    clip_tolerance = property(lambda self: self._clip.tolerance)
    clip_headroom = property(lambda self: self._clip.headroom)
    clip_backoff = property(lambda self: self._clip.backoff)
    sync_interval = property(lambda self: self._span.interval)
    async_verify = property(lambda self: self._span.async_verify)
    snapshot_interval = property(lambda self: self._rollback_point.interval)
    events = property(lambda self: self._verifier.events, doc="skips, rollbacks, fallbacks (OptimizerEvent)")
    last_rollback = property(lambda self: self._verifier.last_rollback, doc="what the last step undid")

    @property
    def step_count(self) -> int:
        """Steps taken so far, skipped and rolled-back ones included (``stats()["steps"]``)."""
        return self._verifier.step

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest step's batch was not applied (skip the scheduler step then)."""
        return self._verifier.last_step_skipped

    @last_step_skipped.setter
    def last_step_skipped(self, value: bool) -> None:
        self._verifier.last_step_skipped = value

    @property
    def replays_missed_windows(self) -> bool:
        """Set by a trainer that replays what a missed clip prediction skipped (no warning then)."""
        return self._verifier.replays_missed_windows

    @replays_missed_windows.setter
    def replays_missed_windows(self, value: bool) -> None:
        self._verifier.replays_missed_windows = value

    @property
    def eight_bit_state(self) -> bool:
        """Whether the inner optimizer keeps its state in 8 bits (bitsandbytes ``optim_bits=8``)."""
        return self._inner is not None and eight_bit_state(self._inner)

    # ---- binding and delegation ---------------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        """Whether the optimizer has its parameters (given at construction or through :meth:`bind`)."""
        return self._inner is not None

    def bind(self, params: Iterable, defaults: dict[str, Any] | None = None) -> RapidFireOptimizer:
        """Give the optimizer its parameters (``model.parameters()`` or param-group dicts); once only.

        Args:
            defaults: hyper-parameters for the inner optimizer where this optimizer was built without
                them (a trainer passes its ``learning_rate``, ``weight_decay``, ...); names the inner
                optimizer's constructor does not take are left out.

        Raises:
            RuntimeError: it is already bound.
        """
        if self._inner is not None:
            raise RuntimeError(
                "RapidFireOptimizer is already bound to parameters; bind() may be called once."
            )
        kwargs = dict(self._inner_kwargs)
        if defaults:
            import inspect

            accepted = inspect.signature(resolve_inner_class(self._spec)).parameters
            taken = {k: v for k, v in defaults.items() if k in accepted and k not in kwargs}
            kwargs.update(taken)
            self.defaults_taken = taken
        self._attach(build_inner(self._spec, normalize_param_groups(params), kwargs, self._fused))
        return self

    def _attach(self, inner: torch.optim.Optimizer) -> None:
        self._inner = inner
        if self._want_pipeline:
            self.enable_pipeline()

    @property
    def _params(self) -> list[torch.Tensor]:
        """The parameters of the inner optimizer's groups, read afresh: ``accelerator.prepare`` under
        FSDP2 (and DeepSpeed) puts new (sharded) tensors into the groups after the optimizer was
        bound, and a list kept from binding would check, clip and snapshot the old ones."""
        if self._inner is None:
            return []
        return [p for g in self._inner.param_groups for p in g["params"]]

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (raises if unbound)."""
        if self._inner is None:
            raise RuntimeError(
                "RapidFireOptimizer has no parameters yet: pass them, "
                "RapidFireOptimizer(model.parameters(), ...), call opt.bind(params), or give the "
                "optimizer to a trainer (PPOTrainer(optimizer=opt)) which binds it to the model."
            )
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.inner.defaults = value

    def __repr__(self) -> str:
        inner = type(self._inner).__name__ if self._inner is not None else f"{self._spec!r} (unbound)"
        return (
            f"RapidFireOptimizer(inner={inner}, pipeline={self.pipeline_enabled}, "
            f"rollback={self.rollback!r}, max_grad_norm={self.max_grad_norm})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)
        if self._pipeline is not None:
            self._pipeline.attach(self.inner)
        self._rollback_point.invalidate()  # the snapshot lacks the new parameters

    def _join(self) -> None:
        """Wait (on the device) for bucket steps still queued on the pipeline's side stream."""
        if self._pipeline is not None:
            self._pipeline.join()

    def state_dict(self) -> dict[str, Any]:
        self._join()
        sd = self.inner.state_dict()
        counters = {**self._verifier.counts, **self._clip.counts, **self._windows}
        sd["rapidfire"] = {
            "health": self._verifier.health.state_dict(),
            "norm_history": list(self._clip.history),
            "counters": dict(counters),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._join()
        self._rollback_point.snapshot.wait()  # a snapshot copy may still be reading what is overwritten
        state_dict = dict(state_dict)
        extra = state_dict.pop("rapidfire", None)
        self.inner.load_state_dict(state_dict)
        if extra is not None:
            self._verifier.health.load_state_dict(extra["health"])
            counters = extra["counters"]
            self._clip.load(extra["norm_history"], counters)
            self._verifier.load_counts(counters)
            self._windows = Counter({k: v for k, v in counters.items() if k in WINDOW_COUNTS})
        if self._pipeline is not None:
            self._pipeline.rebuild(self.inner)  # load_state_dict replaced the groups and the state dict
        self._rollback_point.invalidate()  # the next pipelined window snapshots afresh
        self._span.clear()  # unverified steps of the old state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        if self._pipeline is not None and not self._pipeline.stepped:
            self._pipeline.reset_window()  # a window discarded before anything was applied

    def set_loss_scale(self, scale: float) -> None:
        """The typical size of a loss that is signed and near zero (``HealthMonitor.set_loss_scale``):
        the loss-spike rule never divides by less. PPOTrainer sets 1.0."""
        self._verifier.health.set_loss_scale(scale)

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        """Clip at ``max_grad_norm`` from the next window on (a trainer handing its own setting to an
        optimizer built without one); the pipeline then records the gradient norms it needs."""
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r}: a positive number, or None for no clipping")
        self._clip.set_max_norm(max_grad_norm)
        if self._pipeline is not None and max_grad_norm is not None:
            self._pipeline.need_norms = True

    # ---- pipeline switches --------------------------------------------------------------------------
    @property
    def pipeline_enabled(self) -> bool:
        return self._pipeline is not None and self._pipeline.enabled

    def enable_pipeline(self) -> None:
        """Step parameters during backward from the next closing window on."""
        if self._inner is None:
            self._want_pipeline = True
            return
        if self._pipeline is None:
            need_norms = self.max_grad_norm is not None or self.rollback == "auto"
            self._pipeline = GradientPipeline(
                self._plan_window,
                self.accumulation_steps,
                need_norms,
                self.pipeline_bucket_mb,
                overlap=self.pipeline_overlap,
                max_in_flight=self.side_stream_depth,
                share=self.pipeline_share,
                depth=self.pipeline_depth,
            )
            self._pipeline.attach(self._inner)
            devices = {p.device for p in self._params if p.is_cuda}
            if self.pipeline_overlap > 0 and len(devices) == 1:
                self._rollback_point.snapshot.shared_stream = self._pipeline.stream_for(devices.pop())
        self._pipeline.enabled = True

    def disable_pipeline(self) -> None:
        """Step in ``step()`` again from the next window on (a window already being stepped finishes)."""
        self._want_pipeline = False
        if self._pipeline is not None:
            self._pipeline.enabled = False

    # ---- health inputs ------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Give the loss of the current micro-batch to the health rules (finite loss, loss spike).

        Call once per micro-batch, before or after its backward and before ``step()``; the window's
        value is the mean of the observed losses. Does nothing when ``rollback="off"``.
        """
        if self.rollback == "auto":
            self._verifier.health.observe_loss(loss)

    def record(self, name: str, value: torch.Tensor | float, reduce: str = "mean") -> None:
        """Record a metric (a device tensor, no host sync) for user rules, e.g. PPO's ``approx_kl``.

        ``reduce`` combines several records in one window: ``"mean"``, ``"max"`` or ``"last"``.
        Does nothing when ``rollback="off"``.
        """
        if self.rollback == "auto":
            self._verifier.health.record(name, value, reduce)

    def add_rule(self, name: str, rule: Rule) -> None:
        """Add a health rule: ``rule(metrics) -> bool tensor`` (True = healthy).

        ``metrics`` holds ``loss``, ``loss_z``, ``grad_norm``, ``grad_norm_z`` when known and every
        recorded name. Example: ``opt.add_rule("approx_kl", lambda m: m["approx_kl"] < 0.05)``.

        Raises:
            ValueError: ``rollback="off"`` (the rule would never be checked) or the name is taken.
        """
        if self.rollback != "auto":
            raise ValueError("add_rule() needs rollback='auto'; with rollback='off' no rule is checked.")
        rules = self._verifier.health.rules
        if name in rules:
            raise ValueError(f"A rule named {name!r} already exists.")
        rules[name] = rule

    # ---- the step -----------------------------------------------------------------------------------
    def step(self, closure=None) -> None:
        """Finish the window: verify, then apply (or, for a pipelined window, keep or roll back) the update.

        Raises:
            ConsecutiveSkipsError: ``max_consecutive_skips`` steps in a row were skipped (this one
                included; the weights are those before the first of them).
            RuntimeError: a closure was given (it would re-run forward and backward after the pipeline
                already consumed the gradients), or the optimizer is unbound.
        """
        if closure is not None:
            raise RuntimeError("RapidFireOptimizer does not support closures: call backward() before step().")
        inner = self.inner
        self._join()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        self._verifier.begin_step()
        if self._span.active:
            self._span.step(inner, self._pipeline, self._params)
        elif self._pipeline is not None and self._pipeline.window_pipelined:
            self._finish_pipelined(inner)
        else:
            self._step_in_place(inner)
        self._verifier.step_done()
        if self._pipeline is not None:
            self._pipeline.reset_window()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        self._verifier.streak.check()

    def _step_in_place(self, inner: torch.optim.Optimizer) -> None:
        """Non-pipelined window: every gradient is here, so verify first and apply only a healthy update."""
        params = self._params  # read once: a property that walks the groups
        grads = [p.grad for p in params if p.grad is not None]
        keep_history = self._pipeline is not None and self.max_grad_norm is not None
        need_norm = grads and (self.max_grad_norm is not None or self.rollback == "auto")
        total = get_total_norm(grads) if need_norm else None
        # under FSDP2 the gradients are DTensor shards and so is their norm: verify the global norm (one
        # all-reduce), clip with the DTensor as clip_grads_with_norm_ expects
        metrics, failed, host = self._verifier.verify(
            full_tensor(total), {}, read=self.rollback == "auto" or keep_history, pipelined=False
        )
        if failed:
            self._verifier.skip("skip", failed, metrics, host)
            return
        if self.max_grad_norm is not None and total is not None:
            clip_grads_with_norm_(params, self.max_grad_norm, total)
        self._rollback_point.snapshot.wait()
        inner.step()
        self._verifier.healthy(metrics, host)

    def _finish_pipelined(self, inner: torch.optim.Optimizer) -> None:
        """Pipelined window: verify what the hooks applied, then step the late buckets (parameters whose
        hooks did not step them) with the true clip coefficient, or undo the early ones."""
        pipeline = self._pipeline
        params = self._params
        total = pipeline.window_norm(params, record=pipeline.need_norms)
        flags, true = {}, None
        if self.max_grad_norm is not None and total is not None:
            true = self._clip.true_coef(total)
            flags["clip_prediction"] = self._clip.check(total, true)
        read = bool(flags) or self.rollback == "auto"
        metrics, failed, host = self._verifier.verify(total, flags, read=read, pipelined=True)
        if not failed:
            pipeline.step_leftovers(params, true)
            self._verifier.healthy(metrics, host)
            return
        if "clip_prediction" in failed and host:
            self._clip.missed()
            self._clip.remember(host[0])
            self._clip.back_off()
        if self.rollback == "auto":
            start = time.perf_counter()
            lost = self._rollback_point.rewind(inner)  # the late buckets were never stepped
            self._verifier.rolled_back(time.perf_counter() - start)
            self._verifier.skip("rollback", failed, metrics, host, steps_lost=lost)
        else:
            warnings.warn(
                "RapidFireOptimizer: clipping would have bound on a pipelined step that cannot be "
                "undone (rollback='off'); the step was applied unclipped.",
                stacklevel=3,
            )
            self._verifier.event("clip_miss_unrecoverable", failed, {"grad_norm": host[0] if host else None})
            pipeline.step_leftovers(params, true)
            self._verifier.healthy(metrics, host)

    # ---- spans (sync_interval > 1, or async_verify) -------------------------------------------------
    def _async_verify(self) -> bool:
        return self._span.non_blocking(self._params)

    def verify_now(self) -> Rollback | None:
        """Verify the steps applied since the last verified boundary now (one host read) and undo them if
        one failed. Returns (and sets ``last_rollback`` to) what was undone, or None."""
        self._join()
        return self._span.verify_now(self._inner)

    # ---- the window plan (the pipeline asks at each window's first closing hook) -----------------------
    def _plan_window(self) -> bool:
        """Called at the first closing hook: step in the hooks this window, or defer to ``step()``?"""
        reason = None
        if self._span.active and self._span.verdict is not None:  # the last span's verdict, before any update
            self._span.resolve(mid_window=True, inner=self._inner)
        if self._span.discard:
            reason = "rolled_back"  # this window's gradients came from undone weights: replayed
        elif _multi_process():
            reason = "distributed"  # hooks fire before the gradient all-reduce has finished
        elif accelerate_flag("_mixed_precision", "AcceleratorState") == "fp16":
            reason = "fp16_loss_scaling"  # gradients are still scaled when the hooks fire
        elif not any(b.early for b in self._pipeline.buckets):
            reason = "no_early_bucket"  # pipeline_share 0: every bucket waits for step()
        coef = 1.0
        if reason is None and self.max_grad_norm is not None:
            coef, reason = self._clip.plan()  # a back-off after a miss, or clipping that may bind
        if reason is None and self._span.active:
            self._rollback_point.ensure_span(self._params, self._inner, self._verifier.step)
        elif reason is None and self.rollback == "auto" and not self._ensure_snapshot():
            reason = "snapshot_auto_pipeline_off"
        if reason is not None:
            self._deferred[reason] += 1
            return False
        self._rollback_point.snapshot.wait()
        self._windows["pipelined_steps"] += 1
        self._clip.use(coef)
        self._pipeline.grad_scale = coef
        return True

    def _ensure_snapshot(self) -> bool:
        """Before the hooks apply anything in a window: snapshot the parameters they may step (the early
        buckets) and their state. Returns False when ``snapshot="auto"`` turned the pipeline off instead
        (defer the window)."""
        if self._rollback_point.take_auto_decision():
            self._decide_snapshot()
            if not self.pipeline_enabled:
                return False
        self._rollback_point.ensure(self._pipeline.early_params, self._inner, self._verifier.step)
        return True

    def _decide_snapshot(self) -> None:
        """``snapshot="auto"``, once, before the first snapshot: keep it on the device when it fits (it is
        the fast place: a device copy of 6.15 GiB took 6-8 ms on an H200, a pinned host copy ~125 ms);
        otherwise turn the gradient pipeline off. Rollback stays exact without any snapshot then,
        because a window stepped in ``step()`` is verified before it is applied; the pipeline would
        have saved one gradient copy, the snapshot costs the parameters plus the optimizer state."""
        fits, sizes = device_snapshot_fits(self._params, self._inner)
        if fits:
            return
        self.disable_pipeline()
        self._windows["snapshot_fallbacks"] += 1
        details = {"need_gib": sizes["need"] / GIB, "available_gib": sizes["available"] / GIB}
        self._verifier.event("snapshot_auto_pipeline_off", [], details)
        warn_snapshot_fallback(sizes)

    # ---- counters -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for logging (plain Python numbers; reading them never syncs the device)."""
        clip, snapshot = self._clip, self._rollback_point.snapshot
        return {
            **self._verifier.stats(),
            "pipeline_enabled": self.pipeline_enabled,
            "pipelined_steps": self._windows["pipelined_steps"],
            "deferred_steps": dict(self._deferred),
            "clip_checks": clip.counts["clip_checks"],
            "clip_misses": clip.counts["clip_misses"],
            "clip_coef_predicted": clip.last_coef[0],
            "clip_coef_true": clip.last_coef[1],
            "last_grad_norm": clip.last_norm,
            **(self._pipeline.stats() if self._pipeline is not None else NO_PIPELINE_STATS),
            "verify_seconds": self._verifier.seconds["verify"],
            "rollback_seconds": self._verifier.seconds["rollback"],
            "snapshots": snapshot.count,
            "snapshot_seconds": snapshot.seconds,
            "snapshot_bytes": snapshot.nbytes,
            "snapshot_fallbacks": self._windows["snapshot_fallbacks"],
        }


def _multi_process() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
