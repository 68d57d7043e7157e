"""The throughput planner's decisions against stated memory budgets (rapidfire_hf.memory.planner)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rapidfire_hf.memory.planner import (
    GIB,
    MAX_TRAIN_TOKENS,
    TRAIN_PEAK_FACTOR,
    Asked,
    Budget,
    Probe,
    Workload,
    make_plan,
)

# the 1.1B Llama shape at 128 + 384 tokens, rollout batch 256, the user's micro-batch 8
WORK = Workload(
    rollout_rows=256,
    mini_rows=256,
    micro_rows=8,
    prompt_tokens=128,
    response_tokens=384,
    hidden=2048,
    layers=22,
    vocab=32000,
    kv_bytes_per_token=2 * 22 * 4 * 64 * 2,
    itemsize=2,
)
# activation bytes per row as measured on a 1.1B-like model: recompute keeps less
PROBE = Probe({"none": 400 * 2**20, "elementwise": 250 * 2**20, "matmuls": 80 * 2**20})


def plan(budget_gib: float, **asked):
    return make_plan(WORK, Asked(**asked), PROBE, Budget(target_bytes=int(budget_gib * GIB)), "balanced")


def test_a_large_budget_recomputes_nothing_and_merges_micro_batches():
    p = plan(100)
    assert p.checkpointing == "none" and p.fits
    # merged up to the token cap: 32 rows x 512 tokens = 16384
    assert p.train_rows == MAX_TRAIN_TOKENS // WORK.tokens and p.merge == p.train_rows // 8
    assert p.generation_rows == 256 and p.scoring_rows == 256
    assert p.planned_peak_bytes <= p.target_bytes


def test_a_small_budget_recomputes_and_chunks():
    p = plan(1)
    assert p.checkpointing == "matmuls"  # 8 rows x 400 MiB x 1.3 is far above 1 GiB; 8 x 80 x 1.3 fits
    assert p.train_rows == 8 and p.merge == 1  # never merges while recomputing
    assert p.generation_rows < 256 and p.scoring_rows < 256
    assert 256 % p.generation_rows == 0 or -(-256 // p.generation_rows) * p.generation_rows >= 256


def test_least_recompute_that_fits():
    assert plan(3).checkpointing == "elementwise"  # 8 x 250 MiB x 1.3 = 2.5 GiB fits, 8 x 400 x 1.3 not
    assert plan(4.5).checkpointing == "none"


def test_nothing_fits_says_so():
    p = plan(0.01)
    assert not p.fits and p.checkpointing == "matmuls" and "DOES NOT FIT" in p.table()


def test_explicit_settings_are_kept():
    p = plan(100, scoring_rows=16, generation_rows=64)
    assert (p.scoring_rows, p.generation_rows) == (16, 64)
    assert plan(100, generation_rows=0).generation_rows == 256  # None given explicitly: the whole batch


def test_planner_off_keeps_the_split_and_trl_chunks():
    p = plan(100, planner=False)
    assert (p.train_rows, p.merge, p.checkpointing) == (8, 1, "none")
    assert (p.scoring_rows, p.generation_rows) == (64, 256)


def test_forced_checkpointing_is_applied_and_not_spent_on_batch():
    p = make_plan(WORK, Asked(checkpointing="elementwise"), Probe({"elementwise": 250 * 2**20}),
                  Budget(100 * GIB))  # fmt: skip
    assert p.checkpointing == "elementwise" and p.merge == 1


def test_a_level_without_recompute_never_recomputes_it_splits_the_micro_batch():
    p = make_plan(WORK, Asked(), Probe({"none": 400 * 2**20}), Budget(1 * GIB), "conservative")
    # 8 x 400 MiB x 1.1 = 3.4 GiB does not fit 1 GiB; pieces of 2 rows (0.86 GiB) do
    assert (p.checkpointing, p.train_rows, p.splits, p.forward_rows) == ("none", 8, 2, 2) and p.fits
    assert "4 pieces of 2" in p.table()
    p = make_plan(WORK, Asked(), Probe({"none": 400 * 2**20}), Budget(GIB // 4), "conservative")
    assert p.checkpointing == "none" and not p.fits and p.splits == 0  # not even one row fits


def test_merge_divides_the_micro_batches_of_a_mini_batch():
    work = Workload(**{**WORK.__dict__, "mini_rows": 24, "rollout_rows": 24})  # 3 micro-batches of 8
    p = make_plan(work, Asked(), PROBE, Budget(100 * GIB))
    assert p.merge in (1, 3) and 3 % p.merge == 0


def test_deepspeed_keeps_the_micro_batch():
    assert plan(100, merge=False).merge == 1


def test_held_memory_and_reserve_count_against_the_target():
    free = make_plan(WORK, Asked(), PROBE, Budget(20 * GIB))
    held = make_plan(WORK, Asked(), PROBE, Budget(20 * GIB, held_bytes=13 * GIB, reserve_bytes=4 * GIB))
    assert (free.checkpointing, free.train_rows) == ("none", 32)  # 32 x 400 MiB x 1.1 = 13.8 GiB
    assert (held.checkpointing, held.train_rows) == ("elementwise", 8)  # 3 GiB left: 8 x 250 x 1.1


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="memory.optimization='fast'"):
        make_plan(WORK, Asked(), PROBE, Budget(GIB), "fast")


def test_table_and_metrics():
    p = plan(100)
    text = p.table()
    assert "training micro-batch" in text and "generation chunk" in text and "GiB" in text
    m = p.metrics()
    assert m["rapidfire/plan/train_rows"] == p.train_rows and m["rapidfire/plan/recompute"] == 0


def test_optimizer_state_goes_8_bit_only_under_aggressive_and_only_when_needed():
    from rapidfire_hf.memory.planner import choose_optimizer_state

    # 7B full fine-tuning, four 7B models in bf16 (54 GiB), policy + value trained (27 GiB of gradients)
    weights, grads = 54 * GIB, 27 * GIB
    target = int(0.92 * 140 * GIB)
    assert choose_optimizer_state("aggressive", weights, grads, 2 * grads, grads // 2, target)[0]
    eight, why = choose_optimizer_state("balanced", weights, grads, 2 * grads, grads // 2, target)
    assert not eight and "aggressive would keep it in 8 bits" in why
    eight, why = choose_optimizer_state("aggressive", weights, grads, 2 * grads, grads // 2, target, False)
    assert not eight and "bitsandbytes" in why
    # 1.1B: everything fits, so the arithmetic is never changed
    assert choose_optimizer_state("aggressive", 9 * GIB, 4 * GIB, 8 * GIB, 2 * GIB, target) == (False, "fits")


def test_the_plan_states_each_phase_peak_and_the_planned_peak_is_the_largest():
    p = make_plan(
        WORK,
        Asked(),
        PROBE,
        Budget(target_bytes=100 * GIB, held_bytes=5 * GIB, reserve_bytes=GIB),
        "balanced",
    )
    assert set(p.phase_peak_bytes) == {"training", "scoring", "generation"}
    assert max(p.phase_peak_bytes.values()) == p.planned_peak_bytes
    # generation holds the whole batch's KV cache (plus held and reserve), as the Workload counts it
    assert p.phase_peak_bytes["generation"] == 6 * GIB + p.generation_rows * WORK.generation_row_bytes()
    assert min(p.phase_peak_bytes.values()) > 6 * GIB
    # shown in the printed table and logged to the trackers
    assert "planned peak by phase (GiB): training " in p.table()
    assert p.metrics()["rapidfire/plan/generation_peak_gib"] == round(
        p.phase_peak_bytes["generation"] / GIB, 3
    )


# The 7B LoRA shape of benchmarks/presets/results/h200/lora7b_phases: rollout batch 256, 128 + 384 tokens,
# micro-batch 8, the static engine's KV cache (0.5 MiB per token and row) kept between updates. There the
# plan that ignored the kept cache said 93 GiB and the run peaked at 132 GiB in training.
WORK_7B = replace(
    WORK, mini_rows=64, hidden=4096, layers=32, kv_bytes_per_token=2 * 32 * 32 * 128 * 2, cache_persists=True
)
PROBE_7B = Probe({"none": int(2.6 * GIB), "elementwise": int(1.6 * GIB), "matmuls": int(0.6 * GIB)})
BUDGET_7B = Budget(target_bytes=int(128.6 * GIB), held_bytes=25 * GIB, reserve_bytes=GIB // 4)


def test_a_kept_generation_cache_is_held_while_training_and_scoring_are_planned():
    cache = WORK_7B.held_cache_bytes(256)
    assert cache == 64 * GIB
    forgetful = make_plan(replace(WORK_7B, cache_persists=False), Asked(), PROBE_7B, BUDGET_7B, "aggressive")
    kept = make_plan(WORK_7B, Asked(), PROBE_7B, BUDGET_7B, "aggressive")
    # without the cache the plan merges four micro-batches; beside it only the user's micro-batch fits
    assert forgetful.train_rows == 32 and kept.train_rows == 8
    assert kept.generation_rows == 256 and kept.checkpointing == "none" and kept.fits
    train = (
        BUDGET_7B.held_bytes
        + BUDGET_7B.reserve_bytes
        + int(TRAIN_PEAK_FACTOR * PROBE_7B.activation_bytes["none"] * 8)
    )
    assert kept.phase_peak_bytes["training"] == train + cache
    # the same scoring chunk fits beside the cache; its phase peak now counts the cache
    assert kept.scoring_rows == forgetful.scoring_rows == 256
    assert kept.phase_peak_bytes["scoring"] == forgetful.phase_peak_bytes["scoring"] + cache
    assert kept.planned_peak_bytes == kept.phase_peak_bytes["training"] <= kept.target_bytes
    # the forgetful plan's training peak is what the run really needs minus the cache
    assert forgetful.phase_peak_bytes["training"] + cache > forgetful.target_bytes


def test_the_generation_chunk_shrinks_before_training_recomputes_beside_its_cache():
    tight = Budget(target_bytes=int(100 * GIB), held_bytes=25 * GIB, reserve_bytes=GIB // 4)
    p = make_plan(WORK_7B, Asked(), PROBE_7B, tight, "aggressive")
    # the whole batch's 64 GiB cache leaves no room for 8 rows without recompute; half of it does
    assert p.checkpointing == "none" and p.train_rows == 8
    assert p.generation_rows == 128 and "no more recompute" in p.reasons["generation_rows"]
    assert p.planned_peak_bytes <= p.target_bytes and p.fits
    # a generation chunk the user set is kept: then training recomputes to fit beside its cache
    q = make_plan(WORK_7B, Asked(generation_rows=256), PROBE_7B, tight, "aggressive")
    assert q.generation_rows == 256 and q.checkpointing != "none"
    assert q.phase_peak_bytes["training"] >= WORK_7B.held_cache_bytes(256)


def test_free_cache_gives_the_kept_cache_to_a_bigger_generation_chunk_only_where_it_saves_chunks():
    tight = Budget(target_bytes=int(100 * GIB), held_bytes=25 * GIB, reserve_bytes=GIB // 4)
    kept = make_plan(WORK_7B, Asked(), PROBE_7B, tight, "aggressive")
    freed = make_plan(WORK_7B, Asked(free_cache=True), PROBE_7B, tight, "aggressive")
    # kept: two chunks of 128 (the cache beside training); freed: the whole batch in one chunk
    assert (kept.generation_rows, kept.free_cache) == (128, False)
    assert (freed.generation_rows, freed.free_cache) == (256, True) and freed.fits
    assert "freed after generation (kept, generation would take 2 chunks)" in freed.reasons["generation_rows"]
    # nothing held beside scoring and training: their peaks are the forgetful plan's
    forgetful = make_plan(replace(WORK_7B, cache_persists=False), Asked(), PROBE_7B, tight, "aggressive")
    assert freed.phase_peak_bytes["training"] == forgetful.phase_peak_bytes["training"]
    assert freed.phase_peak_bytes["scoring"] == forgetful.phase_peak_bytes["scoring"]
    assert freed.planned_peak_bytes <= freed.target_bytes
    assert "rollout KV cache" in freed.table() and "rollout KV cache" not in kept.table()
    # where keeping the cache costs no chunk, it is kept (no re-recording for nothing)
    roomy = make_plan(WORK_7B, Asked(free_cache=True), PROBE_7B, BUDGET_7B, "aggressive")
    assert (roomy.generation_rows, roomy.free_cache) == (256, False)
    # a chunk the user set is the user's: nothing freed
    mine = make_plan(WORK_7B, Asked(generation_rows=64, free_cache=True), PROBE_7B, tight, "aggressive")
    assert (mine.generation_rows, mine.free_cache) == (64, False)


def test_without_a_kept_cache_nothing_is_held_across_phases():
    hf = replace(WORK_7B, cache_persists=False)
    assert hf.held_cache_bytes(256) == 0
    p = make_plan(hf, Asked(), PROBE_7B, BUDGET_7B, "aggressive")
    assert p.phase_peak_bytes["training"] == (
        BUDGET_7B.held_bytes
        + BUDGET_7B.reserve_bytes
        + int(TRAIN_PEAK_FACTOR * PROBE_7B.activation_bytes["none"] * p.train_rows)
    )


def test_auto_fused_copies_are_held_only_where_the_plan_stays_the_same():
    """The fused decode projections' weight copies are memory spent on decode speed: "auto" holds them where
    the plan with them held fits and chooses the same split and chunks; never at the plan's expense."""
    from rapidfire_hf.memory.planner import decide_fused_copies

    plain = make_plan(WORK_7B, Asked(), PROBE_7B, BUDGET_7B, "aggressive")  # peak 112.1 of 128.6 GiB

    def decided(copies_gib, want="auto"):
        copies = int(copies_gib * GIB)
        held = make_plan(WORK_7B, Asked(), PROBE_7B, BUDGET_7B.holding(copies), "aggressive")
        return held, decide_fused_copies(plain, held, want, copies)

    held, room = decided(9)  # 9 GiB (the 7B shape's copies) fit in the 16.5 GiB left: the same plan
    assert room.fuse_projections is True and room.fits
    assert (room.train_rows, room.scoring_rows, room.generation_rows, room.checkpointing) == (
        8,
        256,
        256,
        "none",
    )
    assert room.planned_peak_bytes == plain.planned_peak_bytes + 9 * GIB  # the plan counts what it holds
    assert "fit beside the plan unchanged" in room.reasons["fuse_projections"]
    held, costly = decided(18)  # held, the plan would halve the generation chunk: not worth it
    assert held.generation_rows == 128 and held.fits
    assert costly.fuse_projections is False and costly.planned_peak_bytes == plain.planned_peak_bytes
    assert costly.generation_rows == 256
    assert "the generation chunk 256 -> 128" in costly.reasons["fuse_projections"]
    assert "fused decode projections" in costly.table() and "off" in costly.table()
    _, tight = decided(110)  # nothing fits beside 135 GiB held
    assert tight.fuse_projections is False and "would not fit" in tight.reasons["fuse_projections"]
    # asked explicitly: True holds them whatever it costs, False never does
    held, forced = decided(18, want=True)
    assert forced.fuse_projections is True and forced.generation_rows == 128 and forced is not held
    _, never = decided(1, want=False)
    assert never.fuse_projections is False and never.planned_peak_bytes == plain.planned_peak_bytes
    # nothing to fuse (LoRA layers keep their modules): off, and the plan is the plain one
    for want in ("auto", True):  # asked or not, nothing to fuse is said as such, never "on"
        none = decide_fused_copies(plain, plain, want, 0)
        assert none.fuse_projections is False and "no layer to fuse" in none.reasons["fuse_projections"]
    # the decision never writes into the plans it was given
    assert plain.fuse_projections is None and "fuse_projections" not in plain.reasons


def test_without_a_plan_auto_holds_only_small_fused_copies():
    from rapidfire_hf.memory.planner import UNPLANNED_COPY_SHARE, unplanned, unplanned_fused_copies

    plain = unplanned(WORK, Asked(), "none")
    h200 = int(139.8 * GIB)
    small = unplanned_fused_copies(plain, "auto", int(1.2 * GIB), h200)  # the 1.1B shape's copies
    assert small.fuse_projections is True and small.fits and "(no plan)" in small.reasons["fuse_projections"]
    big = unplanned_fused_copies(plain, "auto", 9 * GIB, h200)  # the 7B shape's: 6.4% of the device
    assert big.fuse_projections is False and f"{UNPLANNED_COPY_SHARE:.0%}" in big.reasons["fuse_projections"]
    assert unplanned_fused_copies(plain, True, 9 * GIB, h200).fuse_projections is True
    assert unplanned_fused_copies(plain, "auto", int(1.2 * GIB), 0).fuse_projections is False  # no device


def test_a_micro_batch_that_cannot_fit_even_with_recompute_is_split_in_the_plan():
    """The fewest halvings whose pieces fit, with the least recompute for them; the plan fits by
    construction instead of counting on out-of-memory recovery."""
    p = plan(0.5)  # 8 rows x 80 MiB x 1.1 = 0.69 GiB (matmuls) does not fit 0.5 GiB; 4 rows do
    assert (p.train_rows, p.splits, p.forward_rows, p.merge) == (8, 1, 4, 1) and p.fits
    assert p.checkpointing == "matmuls" and p.planned_peak_bytes <= p.target_bytes
    assert "same mini-batch and optimizer steps" in p.reasons["train_rows"]
    assert "8 in 2 pieces of 4" in p.table()
    assert p.metrics()["rapidfire/plan/splits"] == 1 and p.metrics()["rapidfire/plan/forward_rows"] == 4
    # the training phase's peak is the piece's: 4 rows
    assert p.phase_peak_bytes["training"] == int(1.1 * 80 * 2**20 * 4)
    # where the whole micro-batch fits with recompute, recompute is the trade (no pieces)
    assert plan(1).splits == 0
    # no pieces where the user fixed the rows per forward, under DeepSpeed, or where splitting is refused
    for asked in ({"train_rows": 8}, {"merge": False}, {"split": False}, {"planner": False}):
        q = plan(0.5, **asked)
        assert q.splits == 0 and not q.fits, asked


def test_gradients_count_in_training_only_and_beside_activations_only_when_a_step_has_several_forwards():
    budget = Budget(target_bytes=100 * GIB, held_bytes=10 * GIB, reserve_bytes=6 * GIB, grad_bytes=2 * GIB)
    p = make_plan(WORK, Asked(scoring_rows=8, generation_rows=8), PROBE, budget, "balanced")
    state = 4 * GIB  # the reserve less the gradients: held in every phase
    assert p.phase_peak_bytes["generation"] == 10 * GIB + state + 8 * WORK.generation_row_bytes()
    assert p.phase_peak_bytes["scoring"] == 10 * GIB + state + 8 * WORK.scoring_row_bytes()
    act = int(TRAIN_PEAK_FACTOR * PROBE.activation_bytes["none"] * p.train_rows)
    assert p.merge < WORK.micro_batches  # several forwards a step: gradients and activations both held
    assert p.phase_peak_bytes["training"] == 10 * GIB + state + 2 * GIB + act
    # one forward a step: backward frees activations as it makes gradients, the larger of the two counts
    one = replace(WORK, mini_rows=8, rollout_rows=8)
    q = make_plan(one, Asked(scoring_rows=8, generation_rows=8), PROBE, budget, "balanced")
    act = int(TRAIN_PEAK_FACTOR * PROBE.activation_bytes["none"] * 8)
    assert q.phase_peak_bytes["training"] == 10 * GIB + state + max(act, 2 * GIB)


def test_chunk_sizes_are_every_equal_split_once_and_a_huge_batch_plans_at_once():
    from rapidfire_hf.memory.planner import _chunk_sizes

    for n in (1, 2, 7, 160, 256, 1000):
        assert set(_chunk_sizes(n)) >= {-(-n // k) for k in range(1, n + 1)}
        assert _chunk_sizes(n) == sorted(set(_chunk_sizes(n)), reverse=True) and max(_chunk_sizes(n)) == n
    huge = replace(WORK_7B, rollout_rows=10**9, mini_rows=10**9)
    p = make_plan(huge, Asked(), PROBE_7B, BUDGET_7B, "aggressive")  # was a loop over 10^9 chunk counts
    assert p.generation_rows < 10**9 and p.fits


def test_divisors():
    from rapidfire_hf.memory.planner import _divisors

    for n in (1, 12, 97, 160, 3600):
        assert _divisors(n) == [k for k in range(1, n + 1) if n % k == 0]
