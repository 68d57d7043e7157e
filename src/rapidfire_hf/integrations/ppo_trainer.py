"""``enable_rapidfire`` on a built :class:`PPOTrainer`: the same result as ``PPOConfig(rapidfire_config=...)``.

The trainer rebuilds itself where the rapidfire config acts at construction time
(:meth:`PPOTrainer.apply_rapidfire_config`): the memory callback, the optimizer (when the trainer made its
default one; an optimizer the user passed is kept) with its LR scheduler, and the adaptive-precision plugin.
"""

from __future__ import annotations

from typing import Any


def enable_on_ppo_trainer(trainer, config: Any = None):
    """Apply ``config`` (a ``RapidFireConfig``, preset name, YAML path or dict; ``None`` = balanced) to a
    :class:`PPOTrainer` that has not trained yet, and return it.

    Raises:
        RapidFireIntegrationError: the trainer already trained, or was already enabled.
        ConfigError: the config is invalid.
    """
    from rapidfire_hf.integrations.optimizer import has_stepped
    from rapidfire_hf.integrations.parts import RapidFireIntegrationError

    if trainer.rapidfire_config_applied:
        raise RapidFireIntegrationError(
            "enable_rapidfire was already called on this PPOTrainer; call it once"
        )
    if trainer.state.global_step > 0 or has_stepped(trainer.optimizer):
        raise RapidFireIntegrationError(
            f"this PPOTrainer has already trained (global_step={trainer.state.global_step}); call "
            "enable_rapidfire before trainer.train(), or pass PPOConfig(rapidfire_config=...)"
        )
    trainer.apply_rapidfire_config(config)  # the settings contract, then the parts rebuilt from the config
    return trainer
