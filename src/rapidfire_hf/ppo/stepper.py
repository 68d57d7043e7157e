"""The stepper of PPOTrainer: it owns the optimizer, its step health (a RapidFireOptimizer's verification
or a :class:`~rapidfire_hf.optim.guard.NonFiniteGuard`, behind :class:`~rapidfire_hf.optim.step_health.
StepHealth`), gradient clipping and the out-of-memory split-and-retry of training micro-batches.

One call, :meth:`Stepper.micro_step`, runs a micro-batch's forward and backward (given by the caller) under
accelerate's accumulation, splitting it on OOM, hands its loss to the step health and steps the optimizer
when the accumulation window closes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from rapidfire_hf.memory.oom import OOMRecovery, accelerate_hold
from rapidfire_hf.optim.spans import Rollback
from rapidfire_hf.optim.step_health import ClosedWindow, StepHealth, close_window, step_health
from rapidfire_hf.ppo.recovery import train_recovery


@dataclass
class StepEvents:
    """What happens around a window's optimizer step outside the stepper: the trainer's callbacks, and the
    one observer of the clipped gradients, registered by its owner (None: nothing observes them, and
    nothing is called)."""

    before_step: Callable[[], None]  # before clipping (``on_pre_optimizer_step``)
    # after clipping, before the step: the precision plugin's ``observe_gradients`` (device work, no host read)
    gradients_ready: Callable[[], None] | None
    after_step: Callable[[], None]  # after ``zero_grad`` (``on_optimizer_step``)


def _clips_itself(optimizer) -> bool:
    """Whether the optimizer (under accelerate's wrapper) clips gradients itself (``max_grad_norm`` set)."""
    inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    return getattr(inner, "max_grad_norm", None) is not None


class Stepper:
    """Optimizer steps of PPO's training windows.

    Args:
        accelerator: the trainer's accelerator (accumulation, backward, clipping).
        max_grad_norm: ``clip_grad_norm_`` after backward when > 0, unless the optimizer clips itself.
        max_oom_splits: halvings of a micro-batch after OOM before giving up (0: never split).
        max_consecutive_skips: the guard's limit for a plain optimizer.
        events: the trainer's callbacks around each step.
        release: returns cached memory after an OOM (the bytes given back).

    The optimizer is set with :attr:`optimizer` (again when it is replaced, e.g. by ``enable_rapidfire``): its
    step health is chosen then, once, by its type. The trained module and its parameters are given by
    :meth:`attach` once prepared.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        max_grad_norm: float | None,
        max_oom_splits: int,
        max_consecutive_skips: int | None,
        events: StepEvents,
        release: Callable[[], int] | None = None,
    ):
        self.accelerator = accelerator
        self.max_grad_norm = max_grad_norm
        self.max_oom_splits = max_oom_splits
        self.max_consecutive_skips = max_consecutive_skips
        self.events = events
        self.release = release
        # DeepSpeed's engine owns the step; fp16's GradScaler already skips non-finite steps
        self._guard = (
            accelerator.distributed_type != DistributedType.DEEPSPEED
            and getattr(accelerator, "scaler", None) is None
        )
        self.model: torch.nn.Module | None = None
        self.params: list[torch.Tensor] = []
        self._optimizer = None
        self.health: StepHealth = step_health(None, guard=False)
        self.clips_itself = False
        self._recovery: OOMRecovery | None = None  # built at the first micro-batch
        self.planned_splits = 0  # halvings of every micro-batch the plan asked for (plan.splits)
        # called before the micro-batch whose window steps the optimizer (an offloaded state's copy waited for)
        self.before_window_step: Callable[[], None] | None = None
        # what the latest window's step left in this update (None: none yet, or the health was asked since)
        self.closed: ClosedWindow | None = None

    @property
    def optimizer(self):
        """The optimizer stepped (accelerate's wrapper once prepared)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer) -> None:
        self._optimizer = optimizer
        self.closed = None
        self.health = step_health(
            optimizer, guard=self._guard, max_consecutive_skips=self.max_consecutive_skips, owner="PPOTrainer"
        )
        self.clips_itself = _clips_itself(optimizer)

    def attach(self, model: torch.nn.Module) -> None:
        """The prepared module whose windows are stepped; its trainable parameters are guarded."""
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]

    @property
    def oom_splits(self) -> int:
        """Micro-batch splits after an OOM so far (``rapidfire/oom_splits``)."""
        return len(self._recovery.events) if self._recovery is not None else 0

    def new_update(self) -> None:
        """Memory may differ after a rollout: try whole micro-batches again."""
        self.closed = None
        if self._recovery is not None:
            self._recovery.reset()

    def window_key(self) -> int:
        """Optimizer steps taken so far (skipped included): what a loop keys its next window by. Within an
        update, read from the latest window's close (no second call into the step health)."""
        return self.closed.steps if self.closed is not None else self.health.steps()

    def verify_now(self) -> Rollback | None:
        """Verify every step still unverified (``StepHealth.verify_now``)."""
        self.closed = None
        return self.health.verify_now()

    def micro_step(self, forward_backward: Callable[[dict, float], tuple], chunk: dict) -> tuple:
        """``forward_backward(chunk, weight) -> (LossOutput, entropy)`` of one micro-batch (split in pieces
        on OOM), its loss handed to the step health, and the optimizer step when its window closes."""
        with self.accelerator.accumulate(self.model):
            if self._recovery is None:
                self._recovery = train_recovery(
                    self.max_oom_splits,
                    self.params,
                    self.optimizer,
                    hold=lambda: accelerate_hold(self.accelerator, self.model),
                    release=self.release,
                )
            if self._recovery.planned_splits != self.planned_splits:
                self._recovery.plan_splits(self.planned_splits)
            if self.before_window_step is not None and self.accelerator.sync_gradients:
                self.before_window_step()  # a gradient pipeline steps inside this backward
            out, entropy = self._recovery(forward_backward, chunk)
            self._step(out.loss, out.approx_kl)
        return out, entropy

    def _step(self, loss: torch.Tensor, approx_kl: torch.Tensor) -> None:
        acc = self.accelerator
        # the loss and approx-KL of every micro-batch go to the step health (device tensors only: verified
        # at the end of the window); the window's last ones with its step, in one call (close_window)
        if not acc.sync_gradients:
            self.health.observe_loss(loss)
            self.health.record("approx_kl", approx_kl, reduce="max")
            self.optimizer.step()  # accelerate's wrapper: a no-op inside the window
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.events.before_step()
        grad_norm = None
        if self.max_grad_norm and self.max_grad_norm > 0 and not self.clips_itself:
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.events.gradients_ready is not None:
            self.events.gradients_ready()
        # a NaN/inf loss or gradient never reaches the weights (skipped on the device when it can be)
        self.closed = close_window(
            self.health,
            self.optimizer,
            self.params,
            grad_norm,
            loss=loss,
            records=(("approx_kl", approx_kl, "max"),),
        )
        self.optimizer.zero_grad(set_to_none=True)
        self.events.after_step()
