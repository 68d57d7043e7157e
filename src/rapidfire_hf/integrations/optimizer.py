"""Putting ``RapidFireOptimizer`` into a ``transformers.Trainer`` without changing its hyperparameters.

The trainer builds its own optimizer first (``Trainer.create_optimizer``: its parameter groups with and
without weight decay, ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``optim``), and that
instance becomes the inner optimizer of a ``RapidFireOptimizer``. The LR scheduler is then created on
the wrapper by the trainer as usual, so the schedule is the trainer's own.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from rapidfire_hf.integrations.parts import STATE_ATTR, find_rapidfire_optimizer
from rapidfire_hf.integrations.step_hooks import add_step_observer

logger = logging.getLogger(__name__)


def wrap_optimizer(inner, max_grad_norm: float, pipeline: bool, **kwargs):
    """A ``RapidFireOptimizer`` around an existing optimizer instance.

    Args:
        inner: the optimizer the trainer (or the user) built.
        max_grad_norm: the trainer's clipping threshold (``args.max_grad_norm``; 0 disables clipping).
        pipeline: start with the gradient pipeline on.
        **kwargs: further ``RapidFireOptimizer`` arguments (``rollback``, ``snapshot``, ...).

    Returns:
        The wrapper; ``inner`` is used unchanged (same state, same param groups).
    """
    from rapidfire_hf.optim import RapidFireOptimizer

    kwargs.setdefault("rollback", "auto")
    return RapidFireOptimizer(
        optimizer=inner,
        gradient_pipeline=pipeline,
        max_grad_norm=max_grad_norm if max_grad_norm and max_grad_norm > 0 else None,
        **kwargs,
    )


def has_stepped(optimizer: Any) -> bool:
    """Whether an optimizer has already taken a step (it holds per-parameter state)."""
    state = getattr(optimizer, "state", None)
    return bool(state) and any(bool(s) for s in state.values())


def install_optimizer(trainer, optimizer_kwargs: dict[str, Any] | None = None) -> str:
    """Hook ``trainer.create_optimizer`` so that the optimizer it returns is a ``RapidFireOptimizer``.

    An optimizer passed by the user (``optimizers=(opt, sched)``) is wrapped at once; its scheduler keeps
    working because the wrapper shares the inner optimizer's ``param_groups``.

    Returns:
        A one-line description of what was installed, for the summary log.
    """
    rf_state = getattr(trainer, STATE_ATTR)
    args = trainer.args
    create_optimizer = trainer.create_optimizer

    kwargs = dict(optimizer_kwargs or {})
    grad_cfg = rf_state.config.gradient
    kwargs.setdefault("pipeline_bucket_mb", grad_cfg.bucket_mb)
    kwargs.setdefault("pipeline_share", grad_cfg.overlap_factor)
    kwargs.setdefault("pipeline_depth", grad_cfg.pipeline_depth)
    kwargs.setdefault("clip_tolerance", grad_cfg.clip_tolerance)
    # A missed clip prediction rolls its window back; PPOTrainer replays it, transformers' Trainer cannot
    # (the batch would be lost), so windows where clipping may bind are stepped exactly here unless the
    # caller asks for prediction in optimizer_kwargs.
    kwargs.setdefault("clip_prediction", "exact")

    def ensure_wrapped():
        if trainer.optimizer is not None and find_rapidfire_optimizer(trainer.optimizer) is None:
            trainer.optimizer = wrap_optimizer(
                trainer.optimizer, args.max_grad_norm, rf_state.pipeline, **kwargs
            )
        return trainer.optimizer

    @functools.wraps(create_optimizer)
    def create_rapidfire_optimizer(*a, **kw):
        create_optimizer(*a, **kw)
        return ensure_wrapped()

    trainer.create_optimizer = create_rapidfire_optimizer
    _hook_grad_clipping(trainer)
    if not hasattr(trainer, "_generate_single_turn"):
        # The loss-spike rule suits losses that should fall (SFT, DPO, reward); a GRPO/RLOO loss is a
        # zero-centred policy-gradient surrogate whose z-score says nothing about health.
        _feed_loss(trainer)
    user_given = trainer.optimizer is not None
    ensure_wrapped()
    where = (
        "the optimizer passed to the trainer"
        if user_given
        else f"the trainer's own optimizer ({getattr(args.optim, 'value', args.optim)})"
    )
    return f"RapidFireOptimizer around {where}, gradient pipeline {'on' if rf_state.pipeline else 'off'}"


def _hook_grad_clipping(trainer) -> None:
    """Move gradient clipping and the logged gradient norm into the optimizer.

    With the pipeline, a window's gradients are applied and freed inside backward, so the trainer's
    ``clip_grad_norm_`` before ``optimizer.step()`` would see none. The optimizer clips instead (exactly
    in ``step()`` when clipping may bind, predicted in the hooks otherwise), with the same
    ``max_grad_norm``. The trainer gets a 0-d tensor that the optimizer's step post-hook fills with the
    true pre-clip norm; the trainer reads it (``.item()``) only when it logs, after the step.

    With ``rollback="off"`` the optimizer reads the norm only for pipelined windows it clips; when the
    gradients are still there the trainer measures and clips them itself, as stock does.
    """
    clip, get_norm = trainer._clip_grad_norm, trainer._get_grad_norm
    pending: list[torch.Tensor] = []
    hooked: set[int] = set()

    def placeholder(model):
        opt = find_rapidfire_optimizer(trainer.optimizer)
        if opt is None:
            return None
        if opt.rollback != "auto" and any(p.grad is not None for p in model.parameters()):
            return None
        if id(opt) not in hooked:
            opt.register_step_post_hook(lambda *_: _fill(opt, pending))
            hooked.add(id(opt))
        norm = torch.full((), float("nan"))
        pending.append(norm)
        return norm

    @functools.wraps(clip)
    def clip_grad_norm(model):  # the trainer calls this only when args.max_grad_norm > 0
        norm = placeholder(model)
        return norm if norm is not None else clip(model)

    @functools.wraps(get_norm)
    def get_grad_norm(model, grad_norm=None):
        if grad_norm is None:
            grad_norm = placeholder(model)
        return get_norm(model, grad_norm=grad_norm)

    trainer._clip_grad_norm = clip_grad_norm
    trainer._get_grad_norm = get_grad_norm


def _feed_loss(trainer) -> None:
    """Hand each micro-batch's loss (detached) to the ``RapidFireOptimizer``'s ``observe_loss``."""

    def observe(loss):
        opt = find_rapidfire_optimizer(trainer.optimizer)
        if opt is not None:
            opt.observe_loss(loss.detach())

    add_step_observer(trainer, "optimizer.loss", after=observe)


def _fill(opt, pending: list[torch.Tensor]) -> None:
    """Write the last window's pre-clip gradient norm into the tensors handed to the trainer."""
    norm = opt.stats().get("last_grad_norm")
    if opt.rollback != "auto" and opt.max_grad_norm is None:
        norm = None  # nothing read the norm of this window: NaN rather than an older window's value
    elif opt.last_step_skipped and opt.events:
        norm = opt.events[-1].details.get("grad_norm", norm)
    for t in pending:
        t.fill_(float("nan") if norm is None else norm)
    pending.clear()


def set_pipeline(trainer, enabled: bool) -> None:
    """Turn the gradient pipeline on or off now (or, before training, for when the optimizer is built)."""
    rf_state = getattr(trainer, STATE_ATTR)
    rf_state.pipeline = enabled
    opt = find_rapidfire_optimizer(trainer.optimizer)
    if opt is not None:
        opt.enable_pipeline() if enabled else opt.disable_pipeline()
    logger.info("rapidfire: gradient pipeline %s", "enabled" if enabled else "disabled")
