"""``enable_rapidfire``: rapidfire_hf in any ``transformers.Trainer`` or TRL trainer, in one line."""

from __future__ import annotations

import functools
import logging
from typing import Any

from rapidfire_hf.integrations.parts import STATE_ATTR, RapidFireIntegrationError, RapidFireState

logger = logging.getLogger(__name__)


def _check_fresh(trainer) -> None:
    from transformers import Trainer

    from rapidfire_hf.integrations.optimizer import has_stepped

    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"enable_rapidfire expects a transformers.Trainer or TRL trainer, got {type(trainer).__name__}"
        )
    if getattr(trainer, STATE_ATTR, None) is not None:
        raise RapidFireIntegrationError(
            f"enable_rapidfire was already called on this {type(trainer).__name__}; call it once per trainer"
        )
    if trainer.state.global_step > 0 or has_stepped(trainer.optimizer):
        raise RapidFireIntegrationError(
            f"this {type(trainer).__name__} has already trained (global_step={trainer.state.global_step}); "
            "call enable_rapidfire before trainer.train(), on a freshly built trainer"
        )


def enable_rapidfire(
    trainer,
    config: Any = None,
    *,
    rollout: bool | str = True,
    peak_flops: float | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    lowmem_options: dict[str, int] | None = None,
):
    """Install rapidfire_hf's parts into a ``transformers.Trainer`` or TRL trainer, before ``train()``.

    What is installed (each part only where it exists in this installation and applies):

    - ``RapidFireOptimizer`` around the optimizer the trainer builds from its own arguments (learning
      rate, weight decay, betas, epsilon, ``optim``), or around the one passed in ``optimizers=``; the
      trainer's LR scheduler runs on it. Gradient clipping (``args.max_grad_norm``) moves into the
      optimizer, which is what lets it step during backward. Not with DeepSpeed, which owns the optimizer.
    - OOM split-and-retry in ``training_step`` (``rapidfire_hf.integrations.oom``): a micro-batch that
      raises ``torch.OutOfMemoryError`` is run again in halves with the same update.
    - Selective activation checkpointing of the model's decoder layers (``config.memory.optimization``;
      kept off when the trainer's ``gradient_checkpointing=True`` already checkpoints, which TRL's configs
      default to) and batch prefetch (``config.memory.prefetch_window``), see
      ``rapidfire_hf.integrations.memory_options``.
    - ``MemoryCompactionCallback`` (``config.memory``) and ``AdaptivePrecisionPlugin``
      (``config.precision``; its base precision is the trainer's own ``bf16``/``fp16`` setting, since the
      trainer owns autocast).
    - For GRPO/RLOO: the rollout engine in place of ``model.generate`` (``rollout=False`` keeps HF's).
    - ``rapidfire/*`` metrics in every training log, so ``report_to`` (W&B, TensorBoard) receives them;
      the console line shows a few of them (``rapidfire_hf.integrations.console``).
    - Skipped optimizer steps counted per logging window (``rapidfire/steps_skipped``), each logged with its
      reason, and a NaN loss for a window where every step was skipped
      (``rapidfire_hf.integrations.skips``).
    - ``trainer.disable_pipeline()`` / ``trainer.enable_pipeline()``.
    - With ``config.memory.lowmem`` ``"on"`` / ``"on_8bit_embedding"`` (GRPO/RLOO only): the low-memory
      stack of ``rapidfire_hf.integrations.lowmem.install_lowmem`` (chunked, host-offloaded activation
      checkpointing in place of HF's, the rollout engine released after each rollout with a chunked
      prefill, TRL's LM-head tile 4096, no per-parameter bitsandbytes syncs, ``rollback="off"`` unless
      ``optimizer_kwargs`` sets it). It requires ``max_grad_norm=0.0`` and ``optim="adamw_8bit"`` in the
      trainer's arguments (both change the math against stock TRL; it never sets them for you).

    On rapidfire_hf's own ``PPOTrainer`` it applies ``config`` as ``PPOConfig(rapidfire_config=config)``
    would have (``rapidfire_hf.integrations.ppo_trainer``); the rollout engine is PPOTrainer's own.

    Args:
        trainer: a trainer that has not started training.
        config: a ``RapidFireConfig``, a preset name, a YAML path, or a dict (short or nested form);
            ``None`` for the ``balanced`` defaults.
        rollout: replace generation with the rollout engine in GRPO/RLOO trainers (``True`` or a backend
            name of ``RolloutEngine``: ``"auto"``, ``"static"``, ``"hf"``; ``False`` keeps HF's).
        peak_flops: peak FLOP/s per device for the MFU metric (looked up for known GPUs when ``None``).
        optimizer_kwargs: extra ``RapidFireOptimizer`` arguments (default ``rollback="auto"``, ``"off"`` with
            ``memory.lowmem``; e.g. ``{"snapshot": "host"}`` to keep the rollback snapshot in pinned host memory).
        lowmem_options: ``memory.lowmem``'s chunk sizes, overriding ``LOWMEM_DEFAULTS``: ``rows`` (sequences per
            backward chunk, 16), ``forward_rows`` (32), ``prefill_rows`` (prompts per prefill chunk, 16),
            ``lm_head_chunk`` (TRL's LM-head vocabulary tile, 4096).

    Returns:
        The same trainer, changed in place.

    Raises:
        RapidFireIntegrationError: when called twice on a trainer, or after it started training; with
            ``memory.lowmem`` on, for a trainer other than GRPO/RLOO or arguments it needs (naming them).
        ValueError: for unknown ``lowmem_options`` keys or values.
        ConfigError: for an invalid configuration (naming the bad key and what is allowed).
        TypeError: when ``trainer`` is not a ``transformers.Trainer``.

    Example:
        >>> from trl import GRPOTrainer
        >>> trainer = enable_rapidfire(GRPOTrainer(...), config="aggressive")  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    from rapidfire_hf.config import load_config
    from rapidfire_hf.ppo import PPOTrainer
    from rapidfire_hf.utils.logs import set_log_level

    check_call_arguments(rollout, peak_flops)
    if isinstance(trainer, PPOTrainer):
        from rapidfire_hf.integrations.ppo_trainer import enable_on_ppo_trainer

        if optimizer_kwargs or lowmem_options:
            raise ValueError(
                "optimizer_kwargs and lowmem_options apply to transformers/TRL trainers; for PPOTrainer pass "
                "optimizer=RapidFireOptimizer(...) and set the memory options in the config"
            )
        return enable_on_ppo_trainer(trainer, config)
    _check_fresh(trainer)
    cfg = load_config(config)
    from rapidfire_hf.ppo.settings_check import check_enable_settings

    notes = check_enable_settings(config, optimizer_kwargs)  # the settings contract, before any change
    set_log_level(cfg.logging.level)
    lowmem = cfg.memory.lowmem.value
    if lowmem != "off":
        optimizer_kwargs = _check_lowmem(trainer, lowmem, rollout, optimizer_kwargs, lowmem_options, cfg)
    elif lowmem_options:
        raise ValueError("lowmem_options given but config memory.lowmem is 'off'")
    state = RapidFireState(config=cfg, pipeline=bool(cfg.gradient.pipeline))
    state.installed += notes  # what the config's settings were capped to, said once in the start table
    setattr(trainer, STATE_ATTR, state)
    _install_optimizer(trainer, state, optimizer_kwargs)
    _install_memory(trainer, state)
    _install_memory_options(trainer, state)
    _install_oom(trainer, state)
    _install_precision(trainer, state)
    if rollout:
        _install_rollout(trainer, state, "auto" if rollout is True else rollout)
    if lowmem != "off":
        _install_lowmem(trainer, state, lowmem, lowmem_options)
    _install_skips(trainer, state)
    _install_metrics(trainer, state, peak_flops)
    from rapidfire_hf.distributed import attach_sync_debug

    if attach_sync_debug(trainer) is not None:  # RAPIDFIRE_SYNC_DEBUG=1, as PPOTrainer reads it
        state.installed.append("SyncDebugCallback (RAPIDFIRE_SYNC_DEBUG)")
    trainer.disable_pipeline = functools.partial(_set_pipeline, trainer, False)
    trainer.enable_pipeline = functools.partial(_set_pipeline, trainer, True)
    logger.info(
        "rapidfire: enabled on %s: %s%s",
        type(trainer).__name__,
        "; ".join(state.installed) or "nothing",
        "".join(f"; skipped {s}" for s in state.skipped),
    )
    quiet = cfg.logging.level.value in ("warning", "error")  # the user asked for warnings only
    if not quiet and getattr(trainer.args, "process_index", 0) == 0:
        print(state.table(type(trainer).__name__), flush=True)
    return trainer


# what `rollout=` accepts: on/off, or a RolloutEngine backend by name
ROLLOUT_CHOICES = (True, False, "auto", "static", "hf")


def check_call_arguments(rollout, peak_flops) -> None:
    """Refuse a ``rollout`` that is not one of ``ROLLOUT_CHOICES`` by type and value (``1`` equals ``True``
    but is not a choice) and a ``peak_flops`` that is not a finite number > 0, naming the argument.

    Raises:
        ValueError: naming the argument and what it accepts.
    """
    import math

    if not any(rollout is c or (isinstance(rollout, str) and rollout == c) for c in ROLLOUT_CHOICES):
        allowed = ", ".join(repr(c) for c in ROLLOUT_CHOICES)  # a typo must not become "on" by being truthy
        raise ValueError(f"enable_rapidfire(rollout={rollout!r}): expected one of {allowed}")
    if peak_flops is not None and (
        isinstance(peak_flops, bool)
        or not isinstance(peak_flops, (int, float))
        or not math.isfinite(peak_flops)
        or peak_flops <= 0
    ):
        raise ValueError(
            f"enable_rapidfire(peak_flops={peak_flops!r}): expected a finite number of FLOP/s > 0 per device "
            "(e.g. 989e12), or None to look it up for known GPUs"
        )


def _check_lowmem(trainer, mode: str, rollout, optimizer_kwargs, options, cfg) -> dict[str, Any]:
    """Raise for a trainer or arguments ``memory.lowmem`` cannot use; the optimizer kwargs it runs with."""
    from rapidfire_hf.integrations.lowmem import lowmem_options, lowmem_problems

    lowmem_options(options)  # ValueError for bad keys/values, before anything is changed
    problems = lowmem_problems(trainer, mode, rollout)
    if not cfg.gradient.pipeline:
        problems.append(
            "memory.lowmem needs the gradient pipeline (gradient.pipeline: true): it frees each gradient "
            "as soon as its bucket is stepped"
        )
    if problems:
        raise RapidFireIntegrationError(
            f"cannot apply memory.lowmem={mode!r} to this {type(trainer).__name__}:\n- "
            + "\n- ".join(problems)
        )
    if trainer.args.gradient_accumulation_steps > 1:
        logger.warning(
            "rapidfire: memory.lowmem with gradient_accumulation_steps=%d: gradients live across the "
            "accumulated micro-batches (the measured setting is 1)",
            trainer.args.gradient_accumulation_steps,
        )
    # no rollback snapshot (a full copy of weights + optimizer state) unless asked for
    return {"rollback": "off", **(optimizer_kwargs or {})}


def _install_lowmem(trainer, state: RapidFireState, mode: str, options) -> None:
    from rapidfire_hf.integrations.lowmem import install_lowmem

    patch = state.parts.get("rollout")
    parts = install_lowmem(trainer, mode, options, rollout_patch=patch)
    state.parts["lowmem"] = parts
    if patch is None:
        state.skipped.append("lowmem rollout release / chunked prefill (the rollout engine is not installed)")
    state.installed.append(f"memory.lowmem={mode}: " + "; ".join(parts.applied))


def _set_pipeline(trainer, enabled: bool) -> None:
    from rapidfire_hf.integrations.optimizer import set_pipeline

    set_pipeline(trainer, enabled)


def _install_optimizer(trainer, state: RapidFireState, optimizer_kwargs: dict[str, Any] | None) -> None:
    if trainer.is_deepspeed_enabled:
        state.skipped.append("RapidFireOptimizer (DeepSpeed owns the optimizer)")
    else:
        from rapidfire_hf.integrations.optimizer import install_optimizer

        state.installed.append(install_optimizer(trainer, optimizer_kwargs))


def _install_memory(trainer, state: RapidFireState) -> None:
    from rapidfire_hf.memory import MemoryCompactionCallback

    callback = MemoryCompactionCallback(state.config.memory, telemetry_dir=state.config.logging.telemetry_dir)
    trainer.add_callback(callback)
    state.parts["memory"] = callback
    state.installed.append(f"MemoryCompactionCallback ({state.config.memory.optimization.value})")


def _install_oom(trainer, state: RapidFireState) -> None:
    from rapidfire_hf.integrations.oom import install_oom_recovery

    state.installed.append(install_oom_recovery(trainer))


def _install_memory_options(trainer, state: RapidFireState) -> None:
    from rapidfire_hf.integrations.memory_options import install_checkpointing, install_prefetch

    install_checkpointing(trainer, state)
    install_prefetch(trainer, state)


def _install_precision(trainer, state: RapidFireState) -> None:
    from rapidfire_hf.integrations.callbacks import PrecisionPluginCallback
    from rapidfire_hf.precision import AdaptivePrecisionPlugin
    from rapidfire_hf.precision.schedule import accelerator_precision

    # The trainer's own autocast (args.bf16 / args.fp16) is the base precision the model computes in;
    # the plugin cannot change it from outside, so its `initial` follows the trainer.
    prec = state.config.precision
    initial = accelerator_precision(trainer.accelerator)
    if initial != prec.initial.value:  # said once, in the start table
        state.skipped.append(
            f"precision.initial={prec.initial.value} (the trainer computes in {initial}: its bf16/fp16 "
            "arguments own autocast)"
        )
    callback = PrecisionPluginCallback(AdaptivePrecisionPlugin.from_config(prec, initial=initial), trainer)
    trainer.add_callback(callback)
    state.parts["precision"] = callback
    state.installed.append(f"AdaptivePrecisionPlugin ({prec.mode.value}, base precision {initial})")


def _install_rollout(trainer, state: RapidFireState, backend: str) -> None:
    if not hasattr(trainer, "_generate_single_turn"):
        return  # not a generating trainer: nothing to say
    from rapidfire_hf.integrations.rollout import install_rollout, supports_rollout

    reason = supports_rollout(trainer)
    if reason is not None:
        state.skipped.append(f"rollout engine ({reason})")
        return
    patch = install_rollout(trainer, backend)
    state.parts["rollout"] = patch
    state.installed.append(f"rollout engine (backend={backend}) in place of model.generate")


def _install_skips(trainer, state: RapidFireState) -> None:
    from rapidfire_hf.integrations.skips import install_skip_tracking

    state.parts["skips"] = install_skip_tracking(trainer)  # part of the metrics: no line of its own


def _install_metrics(trainer, state: RapidFireState, peak_flops: float | None) -> None:
    from rapidfire_hf.integrations.metrics import RapidFireMetricsCallback
    from rapidfire_hf.integrations.wandb_logger import RapidFireWandbCallback

    every = state.config.logging.log_every
    # W&B requested in the rapidfire config but not in the trainer's report_to: log there directly.
    direct_wandb = "wandb" in state.config.logging.report_to and "wandb" not in (trainer.args.report_to or [])
    if direct_wandb:
        callback = RapidFireWandbCallback(
            trainer, peak_flops=peak_flops, log_every=every, project=state.config.logging.wandb_project
        )
    else:
        callback = RapidFireMetricsCallback(trainer, peak_flops=peak_flops, log_every=every)
    trainer.add_callback(callback)
    state.parts["metrics"] = callback
    from rapidfire_hf.integrations.console import shorten_console

    shorten_console(trainer)  # all the keys still go to log_history and report_to
    where = "W&B (direct)" if direct_wandb else f"report_to={trainer.args.report_to or []}"
    state.installed.append(f"rapidfire/* metrics to {where}")
