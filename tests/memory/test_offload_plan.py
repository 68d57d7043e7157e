"""memory.offload_plan.choose_offload: host offload is chosen only where the room it frees changes what the
update runs, the cheapest subset that does so is kept, and the level and PPOConfig's host_offload decide
whether it may be made (analytic shapes, no model)."""

from __future__ import annotations

import pytest

from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config
from rapidfire_hf.memory.card_plan import RunShape, card_plan
from rapidfire_hf.memory.estimate import DecoderShape
from rapidfire_hf.memory.offload_plan import choose_offload, copy_bytes, update_work
from rapidfire_hf.memory.planner import GIB, Asked, Budget, Probe, Workload, make_plan

SHAPE = DecoderShape.from_config(llama_config(LLAMA_SHAPES["llama-7b"], 520))
FULL = RunShape(SHAPE, 160, 8, 128, 384, reward_model=True)
WORK = Workload(rollout_rows=64, mini_rows=64, micro_rows=8, prompt_tokens=16, response_tokens=16, hidden=64,
                layers=2, vocab=128, kv_bytes_per_token=512)  # fmt: skip
PROBE = Probe({"none": 10 << 20, "elementwise": 5 << 20, "matmuls": 3 << 20})


def _make(budget):
    return make_plan(WORK, Asked(), PROBE, budget, "aggressive")


def test_the_cheapest_offload_that_gives_the_same_update_is_kept():
    # 100 MiB of room for 8 rows of 10 MiB plus gradients needs recompute; 60 MiB of frozen weights away
    # in training trains without it; the optimizer state (20 MiB) adds nothing more there
    base = Budget(target_bytes=400 << 20, held_bytes=280 << 20, reserve_bytes=40 << 20, grad_bytes=20 << 20)
    assert _make(base).checkpointing != "none"
    chosen, plan = choose_offload(_make, WORK, base, 60 << 20, "aggressive")
    assert plan.checkpointing == "none" and plan.offload_frozen and not plan.offload_state
    assert chosen.frozen_away == 60 << 20 and copy_bytes(chosen) == 60 << 20
    assert "not needed" in plan.reasons["offload_state"]
    assert update_work(plan, WORK) < update_work(_make(base), WORK)


def test_nothing_moves_where_the_room_changes_nothing_or_it_is_not_allowed():
    roomy = Budget(target_bytes=4 << 30, held_bytes=280 << 20, reserve_bytes=40 << 20, grad_bytes=20 << 20)
    chosen, plan = choose_offload(_make, WORK, roomy, 60 << 20, "aggressive")
    assert chosen is roomy and plan.offload_frozen is False and plan.offload_state is False
    assert "changes nothing the update runs" in plan.reasons["offload_frozen"]
    tight = Budget(target_bytes=400 << 20, held_bytes=280 << 20, reserve_bytes=40 << 20, grad_bytes=20 << 20)
    _, plan = choose_offload(_make, WORK, tight, 60 << 20, "conservative")
    assert not plan.offload_frozen and "conservative makes no host offload" in plan.reasons["offload_frozen"]
    _, plan = choose_offload(_make, WORK, tight, 60 << 20, "aggressive", want="off")
    assert not plan.offload_frozen and plan.reasons["offload_frozen"] == "your host_offload='off'"
    _, plan = choose_offload(_make, WORK, roomy, 60 << 20, "balanced", want="on")
    assert (
        plan.offload_frozen
        and plan.offload_state
        and "your host_offload='on'" in plan.reasons["offload_state"]
    )
    with pytest.raises(ValueError, match="host_offload='yes': expected one of auto, on, off"):
        choose_offload(_make, WORK, tight, 60 << 20, "aggressive", want="yes")


def test_the_offloaded_phases_hold_less_only_where_the_weights_are_away():
    on = card_plan(FULL, int(79.19 * GIB), "aggressive", host_offload="on")
    off = card_plan(FULL, int(79.19 * GIB), "aggressive", host_offload="off")
    assert on.offload_frozen and on.offload_state and not off.offload_frozen
    frozen = FULL.frozen_weight_bytes()
    assert frozen == pytest.approx(24.9 * GIB, rel=0.01)
    # same choices forced: scoring holds every weight (the state is away), generation and training not
    same = card_plan(FULL, 1 << 50, "aggressive", host_offload="on")
    plain = card_plan(FULL, 1 << 50, "aggressive", host_offload="off")
    assert (same.train_rows, same.checkpointing, same.generation_rows) == (
        plain.train_rows, plain.checkpointing, plain.generation_rows)  # fmt: skip
    state = FULL.memory().state
    assert plain.phase_peak_bytes["training"] - same.phase_peak_bytes["training"] == frozen
    assert plain.phase_peak_bytes["scoring"] - same.phase_peak_bytes["scoring"] == state
    assert plain.phase_peak_bytes["generation"] - same.phase_peak_bytes["generation"] == frozen + state


def test_a_quantized_or_lora_run_moves_only_what_is_a_separate_frozen_model():
    from dataclasses import replace

    assert FULL.with_frozen("8bit").frozen_weight_bytes() == 0
    lora = replace(FULL, peft=True)  # the reference is the adapter-disabled policy: only the reward model
    assert lora.frozen_weight_bytes() == pytest.approx(SHAPE.params("score") * 2)


def test_the_plan_says_why_quantized_frozen_models_do_not_move():
    """Quantized frozen models stay on the device: the plan's reason says so instead of claiming that no
    frozen model's weights are on it."""
    plan = card_plan(FULL.with_frozen("8bit"), int(79.19 * GIB), "aggressive", host_offload="auto")
    assert not plan.offload_frozen
    assert "quantized" in plan.reasons["offload_frozen"]
