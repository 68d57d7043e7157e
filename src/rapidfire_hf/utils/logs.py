"""The ``logging`` section at work: the library logger's level and the cadence of rapidfire metrics."""

from __future__ import annotations

import logging

LIBRARY_LOGGER = "rapidfire_hf"


def set_log_level(level) -> logging.Logger:
    """Set the level of the ``rapidfire_hf`` logger (``logging.level``: debug / info / warning / error).

    Records below it are dropped at the source; those at or above it go to the application's handlers
    (with none configured, Python prints WARNING and above to stderr).

    Args:
        level: a level name (any case) or a ``LogLevel`` enum.

    Returns:
        The library logger.
    """
    library = logging.getLogger(LIBRARY_LOGGER)
    library.setLevel(level.upper())  # a str, or the config's LogLevel (a str enum: its value's upper())
    return library


def apply_logging_config(cfg) -> None:
    """Apply ``cfg.logging.level`` of a ``RapidFireConfig`` (nothing for ``None``)."""
    if cfg is not None:
        set_log_level(cfg.logging.level)


class LogCadence:
    """Says at which steps rapidfire metrics are logged: ``logging.log_every`` steps apart at least.

    Metrics are attached to a log only when ``every`` steps have passed since they were last attached
    (counting from step 0), so with ``logging_steps`` larger than ``every`` every log carries them.

    Args:
        every: ``logging.log_every`` (1: every log).
    """

    def __init__(self, every: int = 1):
        if every < 1:
            raise ValueError(f"log_every={every!r}: expected an integer >= 1")
        self.every = every
        self.last = 0

    def due(self, step: int) -> bool:
        """True (and the step remembered) when metrics are due at ``step``."""
        if step - self.last >= self.every:
            self.last = step
            return True
        return False

    @classmethod
    def from_config(cls, cfg) -> LogCadence:
        """The cadence of ``cfg.logging.log_every`` (1 without a config)."""
        return cls(cfg.logging.log_every if cfg is not None else 1)
