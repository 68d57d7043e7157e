"""The frozen models' precision for PPOConfig's ``ref_model_quantization`` / ``reward_model_quantization="auto"``.

Holding the frozen reference and reward models in 8 or 4 bits (bitsandbytes) frees memory, but changes their
arithmetic: the KL term and the score move a little (``benchmarks/frozen_quant`` compares the learning
curves). So ``"auto"`` quantizes only where the level allows arithmetic changes (``memory.optimization=
aggressive``, :data:`rapidfire_hf.memory.levels.MEMORY_LEVELS`) and only where it pays: the plan with the
models as given does not fit the card, or makes a trade the quantized plan avoids (the micro-batch split in
pieces, recompute, a smaller scoring or generation chunk, the frozen weights or the optimizer state offloaded
to host memory, 8-bit optimizer state), and the quantized plan makes no trade the other does not. The
smallest change first: 8 bits before 4. Plans are compared, never guessed: :func:`choose_frozen` is a pure
function of the plans, :func:`plan_frozen` makes them with :func:`rapidfire_hf.memory.card_plan.card_plan`
(the same for ``PPOTrainer`` and ``rapidfire plan --frozen-quantization auto``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.card_plan import RunShape, card_plan
from rapidfire_hf.memory.planner import POLICIES, Plan, level_target

AUTO = "auto"
# the smallest change of arithmetic first
ORDER = ("8bit", "4bit")
AS_GIVEN = "as given"
NO_FIT = "does not fit the card"


@dataclass(frozen=True)
class FrozenChoice:
    """What ``"auto"`` chose for the frozen models, and why (said once: plan table row, start report line).

    Attributes:
        bits: ``"8bit"``, ``"4bit"`` or None (as given).
        reason: why, in a few words.
    """

    bits: str | None
    reason: str

    @property
    def label(self) -> str:
        return self.bits or AS_GIVEN

    def line(self) -> str:
        """``frozen models: 8bit (auto, aggressive: ...)``."""
        return f"frozen models: {self.label} ({self.reason})"

    def on(self, plan: Plan) -> Plan:
        """``plan`` with this choice as its "frozen models" row."""
        plan.frozen = self.label
        plan.reasons["frozen_quantization"] = self.reason
        plan.asked["frozen_quantization"] = AUTO
        return plan


def trades_avoided(given: Plan, quantized: Plan) -> list[str] | None:
    """The trades ``given`` makes that ``quantized`` avoids or lessens, in words; None where ``quantized``
    does not fit or makes a trade ``given`` does not (it does not pay)."""
    if not quantized.fits:
        return None
    avoided, added = [], False
    if not given.fits:
        avoided.append(NO_FIT)
    if given.splits != quantized.splits:
        added |= quantized.splits > given.splits
        if given.splits > quantized.splits:
            avoided.append(f"micro-batch in {2**given.splits} pieces")
    order = {p: i for i, p in enumerate(POLICIES)}
    g, q = order.get(given.checkpointing, 0), order.get(quantized.checkpointing, 0)
    added |= q > g
    if g > q:
        avoided.append(f"{given.checkpointing} recompute")
    for name, what in (("scoring_rows", "scoring"), ("generation_rows", "generation")):
        g, q = getattr(given, name), getattr(quantized, name)
        added |= q < g
        if g < q:
            avoided.append(f"{what} chunks of {g} (not {q})")
    for name, what in (
        ("offload_frozen", "host offload of the frozen weights"),
        ("offload_state", "host offload of the optimizer state"),
    ):
        g, q = bool(getattr(given, name)), bool(getattr(quantized, name))
        added |= q and not g
        if g and not q:
            avoided.append(what)
    g, q = given.optimizer_state == "8-bit", quantized.optimizer_state == "8-bit"
    added |= q and not g
    if g and not q:
        avoided.append("8-bit optimizer state")
    return None if added or not avoided else avoided


def choose_frozen(
    level, given: Plan | None, quantized: Mapping[str, Plan], has_frozen: bool = True
) -> FrozenChoice:
    """The frozen models' precision for ``"auto"`` (module docstring).

    Args:
        level: ``memory.optimization`` (None: no rapidfire config, no plan).
        given: the plan with the frozen models as given (None where ``level`` or ``has_frozen`` decides).
        quantized: ``"8bit"`` / ``"4bit"`` -> the plan with the ``"auto"`` models in those bits.
        has_frozen: there is a separate frozen model to quantize (not: LoRA's adapter-disabled reference and
            a rule reward).
    """
    if not has_frozen:
        return FrozenChoice(
            None, "auto: no separate frozen model (LoRA's reference is the adapter-disabled policy)"
        )
    if level is None:
        return FrozenChoice(
            None, "auto: no rapidfire config, no plan; memory.optimization=aggressive may quantize"
        )
    name = to_plain(level)
    if not level_target(name).frozen_quantization:
        return FrozenChoice(
            None,
            f"auto: memory.optimization={name} keeps their arithmetic; only aggressive may quantize them",
        )
    if given is None:
        raise ValueError("choose_frozen needs the plan with the frozen models as given")
    for bits in ORDER:
        avoided = trades_avoided(given, quantized[bits]) if bits in quantized else None
        if avoided:
            rest = [a for a in avoided if a != NO_FIT]
            if NO_FIT in avoided:
                why = f"the plan as given {NO_FIT}" + (f" and needs {', '.join(rest)}" if rest else "")
            else:
                why = f"the plan as given needs {', '.join(rest)}"
            return FrozenChoice(bits, f"auto, {name}: {why}")
    if not given.fits:
        return FrozenChoice(None, f"auto, {name}: does not fit in 8 or 4 bits either")
    return FrozenChoice(None, f"auto, {name}: the plan fits; 8 or 4 bits would spare none of its trades")


def plan_frozen(
    run: RunShape, device_bytes: int, level, ref_auto: bool = True, reward_auto: bool = True, **card_kwargs
) -> FrozenChoice:
    """:func:`choose_frozen` over the plans of ``run`` on ``device_bytes`` (:func:`card_plan`, with
    ``card_kwargs``): as given, and with the ``"auto"`` frozen models (the reference where ``ref_auto``, the
    reward model where ``reward_auto``) in each of :data:`ORDER`. Plans are made only where the level allows
    the change."""
    has = (ref_auto and not run.peft) or (reward_auto and run.reward_model)
    if level is None or not has or not level_target(level).frozen_quantization:
        return choose_frozen(level, None, {}, has_frozen=bool(has))
    given = card_plan(run, device_bytes, level, **card_kwargs)
    quantized = {
        bits: card_plan(run.with_frozen(bits, ref_auto, reward_auto), device_bytes, level, **card_kwargs)
        for bits in ORDER
    }
    return choose_frozen(level, given, quantized)
