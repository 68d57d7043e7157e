"""``enable_rapidfire`` on a built :class:`PPOTrainer`: the same result as ``PPOConfig(rapidfire_config=...)``.

The trainer is rebuilt where the rapidfire config acts at construction time: the memory callback, the
optimizer (when the trainer made its default one; an optimizer the user passed is kept) with its LR
scheduler, and the adaptive-precision plugin.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def enable_on_ppo_trainer(trainer, config: Any = None):
    """Apply ``config`` (a ``RapidFireConfig``, preset name, YAML path or dict; ``None`` = balanced) to a
    :class:`PPOTrainer` that has not trained yet, and return it.

    Raises:
        RapidFireIntegrationError: the trainer already trained, or was already enabled.
        ConfigError: the config is invalid.
    """
    from rapidfire_hf.config import load_config
    from rapidfire_hf.integrations.optimizer import has_stepped
    from rapidfire_hf.integrations.parts import RapidFireIntegrationError

    if getattr(trainer, "_rapidfire_enabled", False):
        raise RapidFireIntegrationError(
            "enable_rapidfire was already called on this PPOTrainer; call it once"
        )
    if trainer.state.global_step > 0 or has_stepped(trainer.optimizer):
        raise RapidFireIntegrationError(
            f"this PPOTrainer has already trained (global_step={trainer.state.global_step}); call "
            "enable_rapidfire before trainer.train(), or pass PPOConfig(rapidfire_config=...)"
        )
    cfg = load_config(config)
    from rapidfire_hf.config.contract import TRAINER, raise_refusals
    from rapidfire_hf.ppo.settings_check import check_trainer_config

    own = None if trainer._optimizer_is_default else getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    raise_refusals(check_trainer_config(trainer.args, {} if config is None else config, own), TRAINER)
    trainer.rf_config = cfg
    trainer.args.rapidfire_config = cfg
    _replace_memory_callback(trainer)
    if trainer._optimizer_is_default:
        _rebuild_optimizer(trainer)
    else:
        logger.info(
            "rapidfire: PPOTrainer keeps the optimizer passed to it; config.gradient applies to it only "
            "if it is a RapidFireOptimizer built with those settings"
        )
    trainer.precision_plugin = trainer._make_precision_plugin()
    trainer._rapidfire_enabled = True
    return trainer


def _replace_memory_callback(trainer) -> None:
    old = trainer.memory_callback
    if old is not None:
        trainer.callback_handler.remove_callback(old)
    trainer.memory_callback = trainer._make_memory_callback()
    if trainer.memory_callback is not None:
        trainer.callback_handler.add_callback(trainer.memory_callback)


def _rebuild_optimizer(trainer) -> None:
    """A config-built optimizer and scheduler in place of the default AdamW, prepared like the first."""
    acc = trainer.accelerator
    old = trainer.optimizer
    if old in acc._optimizers:
        acc._optimizers.remove(old)
    module = acc.unwrap_model(trainer.model)
    optimizer, scheduler = trainer._make_optimizer(module, None, (None, None))
    trainer.optimizer = acc.prepare(optimizer)
    trainer.lr_scheduler = scheduler
    trainer.callback_handler.optimizer = trainer.optimizer
    trainer.callback_handler.lr_scheduler = scheduler
