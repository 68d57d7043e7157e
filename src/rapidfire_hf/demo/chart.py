"""The demo chart's marks of what good looks like: the reward's range and the KL scale.

The demo's reward (``objective/scores``) is :func:`~rapidfire_hf.demo.task.vowel_reward`, vowels counted up
to ``target`` and divided by it (0 to 1), minus ``missing_eos_penalty`` for a response that does not end
with EOS within ``response_length`` tokens. So it lies in ``[-penalty, 1]``: 1.0 is the best possible
(``target`` vowels, then EOS). It starts below 0 because the untrained policy seldom writes EOS in time.

``objective/kl`` is the policy's KL to the reference (the starting policy), in nats summed over a
response's tokens; PPO pays ``kl_coef * KL`` out of each reward. The KL marks say where that penalty
costs one vowel (``1 / target`` of reward) and where it costs as much as a missing EOS: past the second the
penalty outweighs what the policy can still gain by writing vowels, so a KL held there or above means the
policy has moved far from where it started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# what the demo plots: log key -> panel label
SERIES = {"objective/scores": "reward", "objective/kl": "KL (nats per response)"}


@dataclass(frozen=True)
class Mark:
    """A horizontal line on a panel of the chart: at ``y``, described by ``label`` in the legend."""

    y: float
    label: str


def chart_marks(kl_coef: float, missing_eos_penalty: float | None, target: int = 8) -> dict[str, list[Mark]]:
    """The marks of the demo chart's panels, by log key (see the module for what they mean).

    Args:
        kl_coef: the run's KL coefficient (no KL marks when it is 0).
        missing_eos_penalty: subtracted from a response without EOS (None: no penalty).
        target: vowels that earn the full reward (``vowel_reward``'s ``target``).

    Returns:
        ``{"objective/scores": [...], "objective/kl": [...]}``.
    """
    penalty = missing_eos_penalty or 0.0
    reward = [Mark(1.0, f"best possible: {target}+ vowels, then EOS")]
    if penalty:
        reward.append(Mark(0.0, f"0: untrained responses miss EOS (-{penalty:g} each), so it starts below"))
        reward.append(Mark(-penalty, f"worst: no vowel, no EOS (-{penalty:g})"))
    else:
        reward.append(Mark(0.0, "worst: no vowel"))
    kl: list[Mark] = []
    if kl_coef > 0:
        vowel = 1.0 / target
        kl.append(Mark(vowel / kl_coef, f"penalty {kl_coef:g} x KL = one vowel ({vowel:g})"))
        if penalty:
            kl.append(Mark(penalty / kl_coef, f"penalty = a missing EOS ({penalty:g}): far from the start"))
    return {"objective/scores": reward, "objective/kl": kl}


def plot_demo_chart(history: list[dict], path: str | Path, args) -> Path:
    """Save the demo's reward and KL curves with the marks of :func:`chart_marks` for the PPOConfig ``args``."""
    from rapidfire_hf.utils.reporting import plot_curves

    marks = chart_marks(args.kl_coef, args.missing_eos_penalty)
    return plot_curves(
        history,
        path,
        SERIES,
        title="rapidfire demo: PPO reward and KL per update",
        marks={key: [(m.y, m.label) for m in found] for key, found in marks.items()},
    )


__all__ = ["SERIES", "Mark", "chart_marks", "plot_demo_chart"]
