"""One ``training_step`` wrapper per trainer, shared by the rapidfire parts that watch each micro-batch.

The parts that need to see every micro-batch (the optimizer's loss-health rules, the precision plugin's
calibration and loss, the token count of the metrics) register a :class:`StepObserver` with
:func:`add_step_observer` instead of wrapping ``trainer.training_step`` themselves. The first
registration on a trainer installs a single instance-attribute wrapper around the ``training_step`` the
trainer had then (``trainer.training_step.__wrapped__`` is that method); later registrations only add to
the trainer's list of observers. When that method was the class's own, the wrapper calls the method of
the trainer's class at each step, so a class given to the trainer later (the OOM split) takes part.

Order contract, per call of ``trainer.training_step(model, inputs, ...)``:

1. every observer's ``before(model, inputs)``, in registration order;
2. the wrapped ``training_step`` (its return value is the loss);
3. every observer's ``after(loss)``, in registration order, with the loss tensor as returned (not
   detached: an observer that keeps it detaches it itself);
4. the loss is returned unchanged.

An exception propagates at once: from a ``before`` hook it skips the later ``before`` hooks and the step,
from the step it skips every ``after`` hook, from an ``after`` hook it skips the later ``after`` hooks.

``enable_rapidfire`` registers, in this order: the optimizer's loss feed (``after``: the loss reaches
``RapidFireOptimizer.observe_loss``), the precision plugin (``before``: calibration on the first
micro-batch; ``after``: the loss of the window), the skipped-step tracking (``after``: the loss of each
micro-batch, for the logged loss of ``integrations/skips.py``), the metrics (``before``: the micro-batch's
tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OBSERVERS_ATTR = "_rapidfire_step_observers"


@dataclass
class StepObserver:
    """Hooks run around each ``training_step`` call of a trainer.

    Attributes:
        name: what the observer is for (e.g. ``"optimizer.loss"``), to find it in :func:`step_observers`.
        before: ``before(model, inputs)``, called before the step; ``None`` for none.
        after: ``after(loss)``, called with the step's loss; ``None`` for none.
    """

    name: str
    before: Callable[[Any, Any], None] | None = None
    after: Callable[[Any], None] | None = None


def step_observers(trainer) -> list[StepObserver]:
    """The observers of ``trainer.training_step``, installing its wrapper when the trainer has none yet.

    The wrapper is installed once per trainer; every later call returns the same list, which the
    wrapper reads on each step (appending to or removing from it takes effect at the next step).

    Args:
        trainer: a ``transformers.Trainer`` or TRL trainer.

    Returns:
        The trainer's list of :class:`StepObserver`, in the order their hooks run.
    """
    observers = vars(trainer).get(OBSERVERS_ATTR)
    if observers is not None:
        return observers
    observers = []
    training_step = trainer.training_step
    # the class's own method (no instance override yet) is looked up on each call, so a part that later
    # gives the trainer a class of its own (the OOM split of integrations/oom.py) is still called
    from_class = "training_step" not in vars(trainer)

    @functools.wraps(training_step)
    def observed_training_step(model, inputs, *args, **kwargs):
        hooks = tuple(observers)
        for observer in hooks:
            if observer.before is not None:
                observer.before(model, inputs)
        step = type(trainer).training_step.__get__(trainer) if from_class else training_step
        loss = step(model, inputs, *args, **kwargs)
        for observer in hooks:
            if observer.after is not None:
                observer.after(loss)
        return loss

    trainer.training_step = observed_training_step
    setattr(trainer, OBSERVERS_ATTR, observers)
    return observers


def add_step_observer(
    trainer,
    name: str,
    before: Callable[[Any, Any], None] | None = None,
    after: Callable[[Any], None] | None = None,
) -> StepObserver:
    """Register hooks around ``trainer.training_step`` after those already registered.

    Args:
        trainer: a ``transformers.Trainer`` or TRL trainer.
        name: what the observer is for.
        before: ``before(model, inputs)``, run before the step.
        after: ``after(loss)``, run after the step with its loss.

    Returns:
        The registered :class:`StepObserver`.
    """
    observer = StepObserver(name=name, before=before, after=after)
    step_observers(trainer).append(observer)
    return observer


__all__ = ["OBSERVERS_ATTR", "StepObserver", "add_step_observer", "step_observers"]
