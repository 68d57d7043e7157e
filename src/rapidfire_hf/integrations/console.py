"""A short console line: the trainer's printed log shows a few ``rapidfire/*`` metrics, not all of them.

``enable_rapidfire`` adds some thirty ``rapidfire/*`` keys to each training log (optimizer, memory and
precision counters). Printed in full by transformers' ``ProgressCallback`` / ``PrinterCallback`` they made a
GRPO line about 1,800 characters long (TRL's own keys are about 700 of them). :func:`shorten_console`
gives those two callbacks a copy of each log that keeps the trainer's own keys and only the ``rapidfire/*``
keys of :data:`CONSOLE_KEYS`; ``trainer.state.log_history`` and every reporter of ``report_to`` (W&B,
TensorBoard, ...) still receive all of them.
"""

from __future__ import annotations

import functools

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from rapidfire_hf.integrations.metrics import PREFIX

# what the console line keeps of rapidfire's metrics (when present in the log)
CONSOLE_KEYS = (
    "rapidfire/tokens_per_sec",
    "rapidfire/mfu",
    "rapidfire/memory/max_allocated_gib",
    "rapidfire/steps_skipped",
)


def console_logs(logs: dict) -> dict:
    """``logs`` without the ``rapidfire/*`` keys that are not in :data:`CONSOLE_KEYS` (a new dict)."""
    return {k: v for k, v in logs.items() if not k.startswith(PREFIX) or k in CONSOLE_KEYS}


def shorten_console(trainer) -> int:
    """Make the trainer's console printers print :func:`console_logs` of each log.

    Returns:
        How many printer callbacks were changed (0 when the trainer prints no logs).
    """
    changed = 0
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, (ProgressCallback, PrinterCallback)) and "on_log" not in vars(callback):
            callback.on_log = _short_on_log(callback.on_log)
            changed += 1
    return changed


def _short_on_log(on_log):
    @functools.wraps(on_log)
    def short_on_log(args, state, control, logs=None, **kwargs):
        if logs is None:
            return on_log(args, state, control, logs=logs, **kwargs)
        short = console_logs(logs)
        before = set(short)
        result = on_log(args, state, control, logs=short, **kwargs)
        for key in before - set(short):  # PrinterCallback pops total_flos from the log it is given
            logs.pop(key, None)
        return result

    return short_on_log


__all__ = ["CONSOLE_KEYS", "console_logs", "shorten_console"]
