"""Gradient clipping for RapidFireOptimizer: the true coefficient, and its prediction for the pipeline.

The pipeline steps parameters in backward hooks, before the window's gradient norm is known. It may do so
only with a clip coefficient known in advance: 1 when the recent norms leave ``headroom`` below
``max_grad_norm``, or (``mode="scale"``) the coefficient of the last window's true norm. After backward
the prediction is checked against the true coefficient; a miss is undone by the optimizer and the next
windows are stepped exactly for a while (the back-off).
"""

from __future__ import annotations

from collections import Counter

import torch

CLIP_HISTORY = 8  # windows of gradient norms the clip prediction looks at
CLIP_BACKOFF_MAX = 16  # most windows stepped exactly after a missed clip prediction
CLIP_EPS = 1e-6  # the epsilon of torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)
COUNTS = ("clip_checks", "clip_misses")  # the counters this component keeps


class ClipPredictor:
    """The clip setting, the recent true gradient norms and the coefficient the hooks apply.

    Args:
        max_norm: clip the global L2 gradient norm to this value (None: no clipping).
        headroom: predict coefficient 1 only while ``headroom * max(recent norms)`` stays below ``max_norm``.
        mode: ``"exact"`` (defer windows where clipping may bind) or ``"scale"`` (predict its coefficient).
        tolerance: largest accepted ``|predicted - true| / true`` coefficient in ``"scale"`` mode.
        backoff: most windows stepped exactly after a miss (doubling from 1 with each further miss).
    """

    def __init__(self, max_norm: float | None, headroom: float, mode: str, tolerance: float, backoff: int):
        if isinstance(backoff, bool) or not isinstance(backoff, int) or backoff < 0:
            raise ValueError(f"clip_backoff={backoff!r}: must be an integer >= 0 (0: no back-off)")
        self.max_norm = max_norm
        self.headroom = headroom
        self.mode = mode
        self.tolerance = tolerance
        self.backoff = backoff
        self.history: list[float] = []  # the last CLIP_HISTORY true norms (host floats)
        self.coef = 1.0  # the coefficient the hooks apply in the current pipelined window
        # after a miss the next windows step exactly (deferred to step()), twice as many after each further
        # miss, so a run whose clipping binds unpredictably does not pay a rollback and a replay for a
        # quarter of its windows (measured on the CPU demo: 0.13x the speed of no config without it)
        self.backoff_left = 0  # windows still to defer
        self.backoff_len = 0  # windows deferred after the last miss
        self.last_coef: tuple[float | None, float | None] = (None, None)  # (predicted, true), last read
        self.counts: Counter = Counter()

    def true_coef(self, total: torch.Tensor) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient for the global norm ``total`` (a device tensor)."""
        return torch.clamp(self.max_norm / (total + CLIP_EPS), max=1.0)

    def check(self, total: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        """Whether the coefficient the hooks applied was right (a 0-d bool tensor, no host read)."""
        self.counts["clip_checks"] += 1
        if self.mode == "scale":  # the predicted coefficient: within tolerance of clip_grad_norm_'s?
            return (self.coef - true).abs() <= self.tolerance * true
        return total + CLIP_EPS <= self.max_norm  # coefficient 1: right iff clipping would not scale

    def plan(self) -> tuple[float | None, str | None]:
        """The coefficient for the hooks of the window starting now, or ``(None, why the window waits
        for step())`` (a back-off after a miss, or clipping that may bind)."""
        if self.backoff_left > 0:
            self.backoff_left -= 1
            return None, "recent_clip_miss"
        coef = self.predict()
        return (coef, None) if coef is not None else (None, "clip_may_bind")

    def predict(self) -> float | None:
        """1.0 when the norm history says clipping cannot bind (``headroom`` margin); with ``"scale"``,
        otherwise ``max_norm / last true norm`` (capped at 1); else None (defer the window)."""
        if not self.history:
            return None
        if self.headroom * max(self.history) + CLIP_EPS <= self.max_norm:
            return 1.0
        if self.mode != "scale":
            return None
        return min(1.0, self.max_norm / (self.history[-1] + CLIP_EPS))

    def set_max_norm(self, max_norm: float | None) -> None:
        self.max_norm = max_norm

    def use(self, coef: float) -> None:
        """The hooks of the window starting now apply ``coef`` (checked by :meth:`check` after backward)."""
        self.coef = coef

    def load(self, history: list[float], saved: dict[str, int]) -> None:
        """The norm history and the counters of a ``state_dict``."""
        self.history = list(history)
        self.counts = Counter({k: v for k, v in saved.items() if k in COUNTS})

    def remember(self, norm: float) -> None:
        self.history = (self.history + [norm])[-CLIP_HISTORY:]

    def missed(self) -> None:
        self.counts["clip_misses"] += 1

    def back_off(self) -> None:
        """After a miss in a verified window: step the next windows exactly (1, 2, 4, ... up to the limit)."""
        self.backoff_len = min(self.backoff, max(1, 2 * self.backoff_len))
        self.backoff_left = self.backoff_len

    def note_read(self, norm: float, pipelined: bool) -> None:
        """A window's true norm reached the host: keep its (predicted, true) coefficients for stats()."""
        self.last_coef = (self.coef if pipelined else None, min(1.0, self.max_norm / (norm + CLIP_EPS)))

    @property
    def last_norm(self) -> float | None:
        return self.history[-1] if self.history else None
