"""PPOConfig's ref/reward_model_quantization="auto" (rapidfire_hf.memory.frozen_choice): the frozen models go to
8 bits, else 4, only under ``aggressive`` and only where the plan as given does not fit or makes a trade the
quantized plan avoids; the choice is a pure function of the planner's plans."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config
from rapidfire_hf.memory.card_plan import RunShape, card_plan
from rapidfire_hf.memory.estimate import DecoderShape
from rapidfire_hf.memory.frozen_choice import choose_frozen, plan_frozen, trades_avoided
from rapidfire_hf.memory.planner import GIB, Asked, Plan

CLEAN = Plan(level="aggressive", train_rows=8, merge=1, checkpointing="none", scoring_rows=64,
             generation_rows=64, planned_peak_bytes=10, target_bytes=20, fits=True)  # fmt: skip
SPLIT = replace(CLEAN, splits=1, checkpointing="elementwise")
SEVEN_B = DecoderShape.from_config(llama_config(LLAMA_SHAPES["llama-7b"], 520))
CARD = Asked(free_cache=True)


def test_a_quantized_plan_that_spares_the_split_is_chosen_and_the_reason_names_the_trade():
    choice = choose_frozen("aggressive", SPLIT, {"8bit": CLEAN, "4bit": CLEAN})
    assert choice.bits == "8bit"  # the smallest change first, though 4 bits would spare it too
    assert "micro-batch in 2 pieces" in choice.reason and "elementwise recompute" in choice.reason
    assert choice.line().startswith("frozen models: 8bit (auto, aggressive: the plan as given needs")


def test_4_bits_only_where_8_do_not_pay():
    still = replace(CLEAN, splits=1)
    assert (
        choose_frozen("aggressive", SPLIT, {"8bit": still, "4bit": CLEAN}).bits == "8bit"
    )  # spares recompute
    assert choose_frozen("aggressive", SPLIT, {"8bit": SPLIT, "4bit": CLEAN}).bits == "4bit"
    assert (
        choose_frozen("aggressive", SPLIT, {"8bit": replace(CLEAN, fits=False), "4bit": CLEAN}).bits == "4bit"
    )


@pytest.mark.parametrize("level", ["conservative", "balanced", "auto"])
def test_no_other_level_changes_the_arithmetic_and_says_so(level):
    choice = choose_frozen(level, replace(SPLIT, fits=False), {"8bit": CLEAN, "4bit": CLEAN})
    assert choice.bits is None and choice.label == "as given"
    assert f"memory.optimization={level}" in choice.reason and "only aggressive" in choice.reason


def test_as_given_where_nothing_pays():
    assert choose_frozen("aggressive", CLEAN, {"8bit": CLEAN, "4bit": CLEAN}).bits is None
    # a quantized plan that spares one trade but makes another does not pay
    offloaded = replace(CLEAN, offload_frozen=True)
    worse = replace(CLEAN, checkpointing="elementwise")
    assert trades_avoided(offloaded, worse) is None
    assert choose_frozen("aggressive", offloaded, {"8bit": worse, "4bit": worse}).bits is None
    # nothing fits in any precision: as given, said
    lost = replace(SPLIT, fits=False)
    choice = choose_frozen("aggressive", lost, {"8bit": lost, "4bit": lost})
    assert choice.bits is None and "does not fit in 8 or 4 bits either" in choice.reason
    reason = choose_frozen("aggressive", lost, {"8bit": CLEAN}).reason
    assert (
        reason
        == "auto, aggressive: the plan as given does not fit the card and needs micro-batch in 2 pieces, "
        "elementwise recompute"
    )


def test_each_trade_is_seen():
    for given, words in (
        (replace(CLEAN, scoring_rows=16), "scoring chunks of 16 (not 64)"),
        (replace(CLEAN, generation_rows=32), "generation chunks of 32 (not 64)"),
        (replace(CLEAN, offload_frozen=True), "host offload of the frozen weights"),
        (replace(CLEAN, offload_state=True), "host offload of the optimizer state"),
        (replace(CLEAN, optimizer_state="8-bit"), "8-bit optimizer state"),
        (replace(CLEAN, checkpointing="matmuls"), "matmuls recompute"),
    ):
        assert trades_avoided(given, CLEAN) == [words]
        assert trades_avoided(CLEAN, given) is None  # the other way round it adds the trade


def test_no_separate_frozen_model_and_no_config_are_said():
    assert "no separate frozen model" in choose_frozen("aggressive", None, {}, has_frozen=False).reason
    assert "no rapidfire config" in choose_frozen(None, None, {}).reason
    with pytest.raises(ValueError, match="needs the plan"):
        choose_frozen("aggressive", None, {})


def test_the_issues_7b_run_on_80_gib_holds_the_frozen_models_in_8_bits_to_train_the_micro_batch_whole():
    """7B full fine-tuning, batch 160, 7B reward model, host offload off, 79.19 GiB: as given the micro-batch
    trains in 2 pieces; with the frozen models in 8 bits it trains whole (tests/cli/test_plan_card.py)."""
    run = RunShape(SEVEN_B, 160, 8, 128, 384, value_mode="fused", reward_model=True)
    device = int(79.19 * GIB)
    choice = plan_frozen(run, device, "aggressive", asked=CARD, host_offload="off")
    assert choice.bits == "8bit" and "micro-batch in 2 pieces" in choice.reason, choice
    assert card_plan(run, device, "aggressive", asked=CARD, host_offload="off").splits == 1
    assert plan_frozen(run, device, "balanced", asked=CARD, host_offload="off").bits is None
    # LoRA with a rule reward: no separate frozen model to quantize
    lora = replace(run, peft=True, reward_model=False)
    assert "no separate frozen model" in plan_frozen(lora, device, "aggressive", asked=CARD).reason
    # on a card with room to spare nothing pays
    assert plan_frozen(run, 400 * GIB, "aggressive", asked=CARD, host_offload="off").bits is None


def test_only_the_auto_models_are_quantized_in_the_plans(monkeypatch):
    from rapidfire_hf.memory import frozen_choice

    seen = []
    monkeypatch.setattr(frozen_choice, "card_plan", lambda run, *a, **k: seen.append(run) or CLEAN)
    run = RunShape(SEVEN_B, 160, 8, 128, 384, reward_model=True, ref_quantization="4bit")
    plan_frozen(run, 80 * GIB, "aggressive", ref_auto=False, reward_auto=True)
    assert [(r.ref_quantization, r.reward_quantization) for r in seen] == [("4bit", None), ("4bit", "8bit"),
                                                                           ("4bit", "4bit")]  # fmt: skip


def test_the_plan_table_says_the_choice_once():
    choice = choose_frozen("aggressive", SPLIT, {"8bit": CLEAN, "4bit": CLEAN})
    table = choice.on(replace(CLEAN, reasons={}, asked={})).table()
    assert table.count("frozen models") == 1 and "8bit" in table and "micro-batch in 2 pieces" in table
    assert "frozen models" not in replace(CLEAN, reasons={}, asked={}).table()  # not asked: no row
