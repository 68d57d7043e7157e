"""RapidFireOptimizer: an inner torch optimizer with gradient pipeline, verification and exact rollback.

How a trainer drives it (what makes the pipeline and rollback work):

1. Bind once: ``if not opt.is_bound: opt.bind(params_or_groups)`` before building the LR scheduler.
2. Per micro-batch: ``opt.observe_loss(loss)`` (finite-loss and loss-spike rules) and
   ``opt.record("approx_kl", approx_kl, reduce="max")`` for metrics that user rules read
   (``opt.add_rule("approx_kl", lambda m: m["approx_kl"] < limit)``); both take device tensors and
   never sync. Then ``backward`` (under ``accelerator.accumulate`` or with ``accumulation_steps=N``).
3. At the end of the window: ``opt.step(); opt.zero_grad()``; if ``opt.last_step_skipped`` the batch
   was not applied (weights and optimizer state are as before it): skip ``scheduler.step()`` to stay
   exactly equal to a run without that batch. ``opt.last_rollback`` (a :class:`Rollback`, or None) lists
   the steps undone and, in ``replay``, the steps whose batches the caller runs again, in order, before
   new ones: a missed clip prediction, and with ``sync_interval > 1`` the healthy steps of a failed span.
   Call ``opt.verify_now()`` before saving or stopping (it verifies what is still unverified and returns
   the same kind of report). A skipped step is logged; ``max_consecutive_skips`` in a row raise
   :class:`ConsecutiveSkipsError`. Plain optimizers get the non-finite check from :class:`NonFiniteGuard`; :class:`StepHealth`
   (``step_health(optimizer, guard=...)``) is one interface in front of either.
4. Clip with ``RapidFireOptimizer(max_grad_norm=...)``, not with ``clip_grad_norm_`` after backward:
   with the pipeline, pipelined gradients are already applied and freed when backward returns.
5. Log ``opt.stats()`` and ``opt.events``; ``opt.disable_pipeline()`` / ``enable_pipeline()`` at will.
"""

from rapidfire_hf.optim.guard import NonFiniteGuard
from rapidfire_hf.optim.health import OptimizerEvent
from rapidfire_hf.optim.inner import INNER_OPTIMIZERS
from rapidfire_hf.optim.optimizer import RapidFireOptimizer
from rapidfire_hf.optim.skips import ConsecutiveSkipsError
from rapidfire_hf.optim.snapshot import Snapshot
from rapidfire_hf.optim.spans import Rollback
from rapidfire_hf.optim.step_health import StepHealth, step_health

__all__ = [
    "INNER_OPTIMIZERS",
    "ConsecutiveSkipsError",
    "NonFiniteGuard",
    "OptimizerEvent",
    "RapidFireOptimizer",
    "Rollback",
    "Snapshot",
    "StepHealth",
    "step_health",
]
