"""RapidFireOptimizer: an inner torch optimizer plus gradient pipeline, verification and exact rollback."""

from __future__ import annotations

import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from rapidfire_hf.optim.health import HealthMonitor, OptimizerEvent, Rule
from rapidfire_hf.optim.inner import build_inner, normalize_param_groups, resolve_inner_class
from rapidfire_hf.optim.options import check_options
from rapidfire_hf.optim.pipeline import GradientPipeline
from rapidfire_hf.optim.skips import SkipStreak
from rapidfire_hf.optim.snapshot import Snapshot
from rapidfire_hf.optim.spans import Rollback, SpanMixin
from rapidfire_hf.optim.verification import CLIP_BACKOFF_MAX, CLIP_EPS, VerificationMixin


def full_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's global value as a plain tensor (a collective, no host sync); other tensors as they are."""
    to_full = getattr(t, "full_tensor", None)
    return to_full() if callable(to_full) else t


class RapidFireOptimizer(SpanMixin, VerificationMixin, torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that wraps an inner optimizer and adds the gradient pipeline, predicted
    clipping, health verification and bit-exact rollback.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects, so LR schedulers,
    ``state_dict()``, ``accelerator.prepare`` and ``transformers.Trainer(optimizers=(opt, sched))`` see
    a normal optimizer.

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
        self._spec = optimizer
        self._inner_kwargs = dict(inner_kwargs)
        self._fused = enable_fused_kernels
        self._want_pipeline = gradient_pipeline
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.rollback = rollback
        self.snapshot_interval = snapshot_interval
        self.sync_interval = sync_interval
        self.async_verify = async_verify
        self._span: list = []  # unverified steps of the current span (sync_interval > 1)
        self._verdict = None  # a closed span's flags on their way to the host
        self._discard = False  # the current window's gradients came from undone weights
        self._span_snapshot_valid = False
        self._report = Rollback([])  # what this step undid, published as last_rollback
        self.last_rollback: Rollback | None = None
        self.clip_headroom = clip_headroom
        self.clip_prediction = checked["clip_prediction"]
        self.clip_tolerance = clip_tolerance
        if isinstance(clip_backoff, bool) or not isinstance(clip_backoff, int) or clip_backoff < 0:
            raise ValueError(f"clip_backoff={clip_backoff!r}: must be an integer >= 0 (0: no back-off)")
        self.clip_backoff = clip_backoff
        self._coef_pred = 1.0  # clip coefficient the hooks apply in the current pipelined window
        self._health = HealthMonitor(grad_z_threshold, loss_z_threshold, warmup_steps)
        self._streak = SkipStreak(max_consecutive_skips, "RapidFireOptimizer")
        self._snapshot_auto = snapshot == "auto"
        self._snapshot = Snapshot("device" if self._snapshot_auto else snapshot)
        self._inner: torch.optim.Optimizer | None = None
        self._pipeline: GradientPipeline | None = None
        self._norm_history: list[float] = []
        self._applied_since_snapshot = 0
        self._snapshot_params: list[
            torch.Tensor
        ] = []  # what the snapshot holds: the early buckets' parameters
        self._counters: Counter = Counter()
        self._deferred: Counter = Counter()
        # clip-miss back-off: after a missed clip prediction the next windows step exactly (deferred to
        # step()), twice as many after each further miss (at most CLIP_BACKOFF_MAX), so a run whose clipping
        # binds unpredictably does not pay a rollback and a replay for a quarter of its windows
        self._clip_backoff = 0  # windows still to defer
        # set by a trainer that replays the windows a missed clip prediction skipped (PPOTrainer); a plain
        # loop gets one warning at the first miss instead
        self.replays_missed_windows = False
        self._warned_unreplayed = False
        self._clip_backoff_len = 0  # windows deferred after the last miss
        self._seconds: Counter = Counter()
        self._last_coef = (None, None)  # (predicted, true) clip coefficient of the last clipped window
        self.events: list[OptimizerEvent] = []
        self.last_step_skipped = False
        # torch.optim.Optimizer's step hooks, honoured in step()
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        if isinstance(optimizer, torch.optim.Optimizer):
            self._attach(optimizer)
        elif params is not None:
            self.bind(params)

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
        self._applied_since_snapshot = self.snapshot_interval  # the snapshot lacks the new parameters
        self._span_snapshot_valid = False

    def _join(self) -> None:
        """Wait (on the device) for bucket steps still queued on the pipeline's side stream."""
        if self._pipeline is not None:
            self._pipeline.join()

    def state_dict(self) -> dict[str, Any]:
        self._join()
        sd = self.inner.state_dict()
        sd["rapidfire"] = {
            "health": self._health.state_dict(),
            "norm_history": list(self._norm_history),
            "counters": dict(self._counters),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._join()
        self._snapshot.wait()  # a snapshot copy may still be reading what is about to be overwritten
        state_dict = dict(state_dict)
        extra = state_dict.pop("rapidfire", None)
        self.inner.load_state_dict(state_dict)
        if extra is not None:
            self._health.load_state_dict(extra["health"])
            self._norm_history = list(extra["norm_history"])
            self._counters = Counter(extra["counters"])
        if self._pipeline is not None:
            self._pipeline.rebuild(self.inner)  # load_state_dict replaced the groups and the state dict
        self._applied_since_snapshot = self.snapshot_interval  # the next pipelined window snapshots afresh
        self._span_snapshot_valid = False
        self._span, self._verdict, self._discard = [], None, False  # unverified steps of the old state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        if self._pipeline is not None and not self._pipeline.stepped:
            self._pipeline.reset_window()  # a window discarded before anything was applied

    def set_loss_scale(self, scale: float) -> None:
        """The typical size of a loss that is signed and near zero (``HealthMonitor.set_loss_scale``):
        the loss-spike rule never divides by less. PPOTrainer sets 1.0."""
        self._health.set_loss_scale(scale)

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        """Clip at ``max_grad_norm`` from the next window on (a trainer handing its own setting to an
        optimizer built without one); the pipeline then records the gradient norms it needs."""
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r}: a positive number, or None for no clipping")
        self.max_grad_norm = max_grad_norm
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
                self._snapshot.shared_stream = self._pipeline.stream_for(devices.pop())
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
            self._health.observe_loss(loss)

    def record(self, name: str, value: torch.Tensor | float, reduce: str = "mean") -> None:
        """Record a metric (a device tensor, no host sync) for user rules, e.g. PPO's ``approx_kl``.

        ``reduce`` combines several records in one window: ``"mean"``, ``"max"`` or ``"last"``.
        Does nothing when ``rollback="off"``.
        """
        if self.rollback == "auto":
            self._health.record(name, value, reduce)

    def add_rule(self, name: str, rule: Rule) -> None:
        """Add a health rule: ``rule(metrics) -> bool tensor`` (True = healthy).

        ``metrics`` holds ``loss``, ``loss_z``, ``grad_norm``, ``grad_norm_z`` when known and every
        recorded name. Example: ``opt.add_rule("approx_kl", lambda m: m["approx_kl"] < 0.05)``.

        Raises:
            ValueError: ``rollback="off"`` (the rule would never be checked) or the name is taken.
        """
        if self.rollback != "auto":
            raise ValueError("add_rule() needs rollback='auto'; with rollback='off' no rule is checked.")
        if name in self._health.rules:
            raise ValueError(f"A rule named {name!r} already exists.")
        self._health.rules[name] = rule

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
        self.last_step_skipped = False
        if self._span_mode:
            self._span_step(inner)
        elif self._pipeline is not None and self._pipeline.window_pipelined:
            self._finish_pipelined(inner)
        else:
            self._step_in_place(inner)
        self._counters["steps"] += 1
        self._health.reset_window()
        if self._pipeline is not None:
            self._pipeline.reset_window()
        self.last_rollback, self._report = (self._report if self._report.steps else None), Rollback([])
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        self._streak.check()

    def _step_in_place(self, inner: torch.optim.Optimizer) -> None:
        """Non-pipelined window: every gradient is here, so verify first and apply only a healthy update."""
        params = self._params  # read once: a property that walks the groups
        grads = [p.grad for p in params if p.grad is not None]
        keep_history = self._pipeline is not None and self.max_grad_norm is not None
        need_norm = grads and (self.max_grad_norm is not None or self.rollback == "auto")
        total = get_total_norm(grads) if need_norm else None
        # under FSDP2 the gradients are DTensor shards and so is their norm: verify the global norm (one
        # all-reduce), clip with the DTensor as clip_grads_with_norm_ expects
        metrics, failed, host = self._verify(
            full_tensor(total), {}, read=self.rollback == "auto" or keep_history
        )
        if failed:
            self._skip("skip", failed, metrics, host)
            return
        if self.max_grad_norm is not None and total is not None:
            clip_grads_with_norm_(params, self.max_grad_norm, total)
        self._snapshot.wait()
        inner.step()
        self._after_healthy(metrics, host)

    def _finish_pipelined(self, inner: torch.optim.Optimizer) -> None:
        """Pipelined window: verify what the hooks applied, then step the late buckets (parameters whose
        hooks did not step them) with the true clip coefficient, or undo the early ones."""
        pipeline = self._pipeline
        pipeline.join()
        params = self._params
        if pipeline.need_norms:
            pipeline.record_norms(pipeline.leftovers(params))
        norms = pipeline.ordered_norms()
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
        flags, true = {}, None
        if self.max_grad_norm is not None and total is not None:
            true = torch.clamp(self.max_grad_norm / (total + CLIP_EPS), max=1.0)
            if self.clip_prediction == "scale":
                # the hooks applied the predicted coefficient: within tolerance of clip_grad_norm_'s?
                flags["clip_prediction"] = (self._coef_pred - true).abs() <= self.clip_tolerance * true
            else:
                # the hooks applied coefficient 1: right iff clip_grad_norm_ would not have scaled
                flags["clip_prediction"] = total + CLIP_EPS <= self.max_grad_norm
            self._counters["clip_checks"] += 1
        metrics, failed, host = self._verify(total, flags, read=bool(flags) or self.rollback == "auto")
        if not failed:
            pipeline.step_leftovers(params, true)
            self._after_healthy(metrics, host)
            return
        if "clip_prediction" in failed and host:
            self._counters["clip_misses"] += 1
            self._remember_norm(host[0])
            self._clip_backoff_len = min(self.clip_backoff, max(1, 2 * self._clip_backoff_len))
            self._clip_backoff = self._clip_backoff_len
        if self.rollback == "auto":
            start = time.perf_counter()
            self._snapshot.restore(self._snapshot_params, inner)  # the late buckets were never stepped
            self._seconds["rollback"] += time.perf_counter() - start
            self._counters["rollbacks"] += 1
            self._skip("rollback", failed, metrics, host, steps_lost=self._applied_since_snapshot)
            self._applied_since_snapshot = 0
        else:
            warnings.warn(
                "RapidFireOptimizer: clipping would have bound on a pipelined step that cannot be "
                "undone (rollback='off'); the step was applied unclipped.",
                stacklevel=3,
            )
            self.events.append(
                OptimizerEvent(
                    self._counters["steps"],
                    "clip_miss_unrecoverable",
                    failed,
                    {"grad_norm": host[0] if host else None},
                )
            )
            pipeline.step_leftovers(params, true)
            self._after_healthy(metrics, host)
