"""PPOTrainer's throughput plan: merged micro-batches train the same update as the user's split (stated
tolerance), explicit settings are kept, the probe is cached and a damaged cache is measured again."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from rapidfire_hf.ppo.recipe.probe_cache import PROBE_CACHE
from tests.ppo.helpers import tiny_trainer


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


def trainer_with(tmp_path, tok, memory: dict, **kw):
    torch.manual_seed(0)
    cfg = {"memory": {"prefetch_window": 0, **memory}, "gradient": {"pipeline": False},
           "precision": {"mode": "static"}}  # fmt: skip
    # rollout batch 8, one mini-batch of four micro-batches of 2 rows: the planner may merge 2 or 4
    base = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=1)
    return tiny_trainer(tmp_path, tok, rapidfire_config=cfg, **{**base, **kw})


def test_merged_micro_batches_train_the_same_update(tmp_path, tokenizer):
    planned = trainer_with(tmp_path / "on", tokenizer, {"planner": True})
    planned.train()
    # (accelerate's gradient state is shared by every Accelerator of the process: read it before the next)
    assert planned.accelerator.gradient_accumulation_steps == 1
    kept = trainer_with(tmp_path / "off", tokenizer, {"planner": False})
    kept.train()
    assert planned.plan.merge == 4 and planned.plan.train_rows == 8  # all four micro-batches in one forward
    assert kept.plan.merge == 1 and kept.plan.train_rows == 2
    # same rollouts (the first update's weights are the same) and the same gradients up to fp32 regrouping
    # of the GEMMs; measured max |diff| 0 to 3e-8 after 2 updates of 2 epochs on a 2-core CPU, except where
    # Adam amplifies it: an element whose gradient is near zero moves by lr * g / (|g| + eps), so a 1e-9
    # regrouping difference there can reach a fraction of lr (measured: one element of 8,192 in
    # layers.0.mlp.down_proj off by 4.4e-6 = 0.0044 lr, with the sampling noise of ppo/seeds.py); held to lr / 100
    for (name, a), b in zip(planned.policy.state_dict().items(), kept.policy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=planned.args.learning_rate / 100, msg=name)
    log_on = [h for h in planned.state.log_history if "loss/policy_avg" in h]
    log_off = [h for h in kept.state.log_history if "loss/policy_avg" in h]
    for on, off in zip(log_on, log_off):
        for key in ("loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "objective/scores"):
            assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    assert log_on[0]["rapidfire/plan/merge"] == 4 and "rapidfire/plan/merge" not in log_off[0]


def test_explicit_chunks_are_kept_and_reach_the_phases(tmp_path, tokenizer):
    trainer = trainer_with(
        tmp_path, tokenizer, {}, local_rollout_forward_batch_size=3, rollout_generation_batch_size=5
    )
    seen = []
    generate = None

    def spy(*args, **kwargs):
        seen.append(args[0].shape[0])
        return generate(*args, **kwargs)

    trainer.train()  # builds the engine; the second run below counts the generation chunks
    generate = trainer.roller.engine.generate
    trainer.roller.engine.generate = spy
    assert (trainer.plan.scoring_rows, trainer.plan.generation_rows) == (3, 5)
    trainer.rollout(trainer.next_prompts(0))
    assert seen == [5, 3]  # 8 prompts in chunks of 5


def test_the_plan_is_printed_once(tmp_path, tokenizer, capsys):
    trainer_with(tmp_path, tokenizer, {}).train()
    out = capsys.readouterr().out
    assert out.count("rapidfire plan (memory.optimization=balanced") == 1
    assert "training micro-batch (rows)" in out and "fits without recompute" in out


def test_no_config_no_plan_printed_and_trl_chunks(tmp_path, tokenizer, capsys):
    trainer = tiny_trainer(tmp_path, tokenizer)
    trainer.train()
    assert "rapidfire plan" not in capsys.readouterr().out
    assert not trainer.plan.planned and trainer.plan.scoring_rows == 64 and trainer.plan.merge == 1


def test_no_config_says_once_when_it_holds_fused_copies(tmp_path, tokenizer, capsys, monkeypatch):
    """Without a plan table, memory held for fused decode projections is said in one line, once; where "auto"
    holds nothing (here: no CUDA device, so no device share to fit in), nothing is said."""
    import rapidfire_hf.ppo.recipe.planning as planning

    fused = tiny_trainer(
        tmp_path / "a", tokenizer, rollout_backend="static", rollout_decode_fuse_projections=True
    )
    fused.train()
    out = capsys.readouterr().out
    assert out.count("rapidfire: fused decode projections on (your rollout_decode_fuse_projections=True") == 1
    assert fused.plan.fuse_projections is True and fused.roller.engine.copy_bytes() > 0
    monkeypatch.setattr(planning, "fuse_wanted", lambda args, device: args.rollout_decode_fuse_projections)
    auto = tiny_trainer(tmp_path / "b", tokenizer, rollout_backend="static")
    auto.train()
    assert "fused decode projections" not in capsys.readouterr().out
    assert auto.plan.fuse_projections is False and auto.roller.engine.copy_bytes() == 0
    # asked for, with nothing to fuse (LoRA on q/v): said as off, with the reason, never "on"
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    asked = tiny_trainer(
        tmp_path / "c",
        tokenizer,
        rollout_backend="static",
        rollout_decode_fuse_projections=True,
        value_mode="fused",
        trainer_kwargs={"peft_config": lora},
    )
    asked.train()
    out = capsys.readouterr().out
    assert "rapidfire: fused decode projections off (no layer to fuse" in out
    assert asked.plan.fuse_projections is False and asked.roller.engine.copy_bytes() == 0


def test_probe_is_cached_and_a_damaged_cache_is_measured_again(tmp_path, tokenizer, caplog):
    first = trainer_with(tmp_path, tokenizer, {})
    first.train()
    cache = tmp_path / PROBE_CACHE
    assert cache.is_file()
    second = trainer_with(tmp_path, tokenizer, {})
    probes = []
    import rapidfire_hf.ppo.recipe.planning as planning

    measure = planning.measure

    def spy(*a, **k):
        probes.append(measure(*a, **k))
        return probes[-1]

    planning.measure = spy
    try:
        second.train()
        assert probes[-1].cached
        cache.write_bytes(b"\xff\x00 not json")
        third = trainer_with(tmp_path, tokenizer, {})
        with caplog.at_level(logging.WARNING):
            third.train()
    finally:
        planning.measure = measure
    assert not probes[-1].cached and "ignoring the plan's probe cache" in caplog.text
    assert third.plan.train_rows == first.plan.train_rows
    assert '"version": 2' in cache.read_text()  # rewritten whole


def test_probe_cache_survives_hostile_folders_and_entries(tmp_path, caplog):
    """A folder name over the system's limit, a folder that cannot be created, negative or NaN entries:
    nothing raises, nothing bad is trusted, the probe is measured again."""
    from rapidfire_hf.ppo.recipe.probe_cache import PROBE_CACHE_VERSION, ProbeCache, identity_key

    me = {"policy": "P", "torch": "1", "transformers": "1", "rapidfire_hf": "1"}
    with caplog.at_level(logging.WARNING):
        long = ProbeCache(tmp_path / ("x" * 300))
        long.put(me, {"none": 5})
        assert long.get(me, ("none",)) is None
        blocked = tmp_path / "file"
        blocked.write_text("")
        under_a_file = ProbeCache(blocked)  # a folder where a file is
        under_a_file.put(me, {"none": 5})
        assert under_a_file.get(me, ("none",)) is None
    assert "could not write the plan's probe cache" in caplog.text
    key = identity_key(me)
    for entry in ('{"none": -3}', '{"none": NaN}', '{"none": true}', '{"other": 4}', "5", "[]"):
        body = '{"identity": ' + json.dumps(me) + ', "bytes": ' + entry + "}"
        (tmp_path / PROBE_CACHE).write_text(
            '{"version": ' + str(PROBE_CACHE_VERSION) + ', "entries": {"' + key + '": ' + body + "}}"
        )
        assert ProbeCache(tmp_path).get(me, ("none",)) is None, entry


@pytest.mark.parametrize("backend,kept", [("static", True), ("hf", False), ("auto", False)])
def test_the_plan_counts_the_kv_cache_only_where_the_engine_keeps_it(
    tmp_path, tokenizer, monkeypatch, backend, kept
):
    """The static engine keeps its KV cache between updates, so the planner holds it through scoring and
    training; model.generate frees it (and "auto" is model.generate on a CPU)."""
    import rapidfire_hf.ppo.recipe.planning as planning

    seen = []
    make_plan = planning.make_plan

    def spy(work, *a, **k):
        seen.append(work)
        return make_plan(work, *a, **k)

    monkeypatch.setattr(planning, "make_plan", spy)
    trainer = trainer_with(tmp_path, tokenizer, {}, rollout_backend=backend)
    trainer.train()
    assert [w.cache_persists for w in seen] == [kept]
    assert trainer.roller.engine.backend == ("static" if kept else "hf")
    cache = seen[0].held_cache_bytes(trainer.plan.generation_rows)
    assert (cache > 0) == kept
    assert (
        trainer.plan.phase_peak_bytes["training"] >= cache
        and trainer.plan.phase_peak_bytes["scoring"] >= cache
    )


def test_the_plan_decides_the_fused_decode_copies_before_they_exist(tmp_path, tokenizer, monkeypatch):
    """rollout_decode_fuse_projections allocates copies of the q/k/v and gate/up weights at the first
    generation, after the plan. True: the plan holds them. "auto" (the default, on a GPU where the step is
    recorded; forced here): held only where the plan with them makes the same choices and fits, and the
    engine built at the first rollout follows the plan's decision."""
    import rapidfire_hf.ppo.recipe.planning as planning
    from rapidfire_hf.memory.planner import Budget
    from rapidfire_hf.rollout.llama_forward import fused_projection_bytes

    budgets = []
    make_plan = planning.make_plan

    def spy(work, asked, probe, budget, *a, **k):
        budgets.append(budget.held_bytes)
        return make_plan(work, asked, probe, budget, *a, **k)

    monkeypatch.setattr(planning, "make_plan", spy)
    room = [2**40]
    monkeypatch.setattr(planning, "level_budget", lambda *a, **k: Budget(room[0], 5 * 2**20, 0))

    def run(name, **kw):
        budgets.clear()
        t = trainer_with(tmp_path / name, tokenizer, {}, rollout_backend="static", **kw)
        t.train()
        policy = t.accelerator.unwrap_model(t.model).policy
        return t, fused_projection_bytes(policy)

    # "auto" on a CPU: nothing to decide (no recorded CUDA step), no row, nothing held
    plain, _ = run("plain")
    assert budgets == [5 * 2**20] and plain.plan.fuse_projections is None
    assert "fused decode projections" not in plain.plan.table()
    assert plain.roller.engine.copy_bytes() == 0
    fused, copies = run("fused", rollout_decode_fuse_projections=True)
    assert copies > 0 and budgets == [5 * 2**20, 5 * 2**20 + copies]
    assert fused.plan.fuse_projections is True and "held" in fused.plan.reasons["fuse_projections"]
    # allocated now: planning again counts nothing more (memory_allocated sees them on a GPU)
    assert fused.roller.engine.copy_bytes() == copies
    assert planning.decode_copies(
        fused.plan_inputs(), fused.accelerator.unwrap_model(fused.model).policy, True
    ) == (
        True,
        0,
        copies,
    )
    # an engine built by a rollout before the plan (outside train()) keeps what it has; the plan says so
    early = trainer_with(
        tmp_path / "early", tokenizer, {}, rollout_backend="static", rollout_decode_fuse_projections=True
    )
    early.rollout(early.next_prompts(0))
    assert early.plan is None and early.roller.engine.copy_bytes() == copies
    early.train()
    assert early.plan.fuse_projections is True
    assert "held by the engine built before the plan" in early.plan.reasons["fuse_projections"]

    monkeypatch.setattr(planning, "fuse_wanted", lambda args, device: args.rollout_decode_fuse_projections)
    roomy, copies = run("auto-roomy")
    assert roomy.plan.fuse_projections is True and roomy.roller.engine.copy_bytes() == copies
    assert re.search(
        r"fused decode projections +auto +on +\d+\.\d MiB of weight copies fit", roomy.plan.table()
    )
    # a budget where the copies would cost the plan: the plan without them runs, the engine fuses nothing
    need = roomy.plan.planned_peak_bytes - copies  # the plan's peak without the copies
    room[0] = need + copies // 2
    tight, _ = run("auto-tight")
    assert tight.plan.fuse_projections is False and tight.roller.engine.copy_bytes() == 0
    assert "would" in tight.plan.reasons["fuse_projections"]
    # and what the run trains does not depend on it: the same rollouts and updates (fp32, CPU)
    for (name, a), b in zip(roomy.policy.state_dict().items(), tight.policy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=roomy.args.learning_rate / 100, msg=name)


def test_a_plan_that_frees_the_cache_releases_the_engine_after_each_rollout_and_trains_the_same(
    tmp_path, tokenizer, monkeypatch
):
    """rollout_cache='auto': where the plan frees the KV cache, the engine is released after every
    generation (rebuilt at the next); the update's numbers are those of the run that keeps it."""
    from dataclasses import replace

    import rapidfire_hf.ppo.recipe.planning as planning

    make_plan = planning.make_plan
    asked_free = []

    def freeing(work, asked, *a, **k):
        asked_free.append(asked.free_cache)
        return replace(make_plan(work, asked, *a, **k), free_cache=True)

    kept = trainer_with(tmp_path / "kept", tokenizer, {}, rollout_backend="static")
    kept.train()
    monkeypatch.setattr(planning, "make_plan", freeing)
    freed = trainer_with(tmp_path / "freed", tokenizer, {}, rollout_backend="static", rollout_cache="auto")
    released = []
    engine_release = type(freed.roller).rollout

    def rollout_then_check(self, *a, **k):
        out = engine_release(self, *a, **k)
        released.append(self.engine.held_bytes())  # before the trainer's release: the cache is there
        return out

    monkeypatch.setattr(type(freed.roller), "rollout", rollout_then_check)
    freed.train()
    assert asked_free == [True] and freed.plan.free_cache
    assert len(released) == 2 and all(b > 0 for b in released)
    assert freed.roller.engine.held_bytes() == 0  # released after the last rollout
    assert kept.roller.engine.held_bytes() > 0
    for a, b in zip(kept.model.parameters(), freed.model.parameters()):
        assert torch.equal(a, b)


def test_the_plan_may_free_the_kv_cache_by_default_and_keep_keeps_it(tmp_path):
    """rollout_cache defaults to 'auto' (same-call H200 evidence in benchmarks/presets, full7b_freecache_stock):
    the plan is asked whether to free the cache unless the user says 'keep'."""
    from rapidfire_hf import PPOConfig
    from rapidfire_hf.config import load_config
    from rapidfire_hf.ppo.recipe.planning import asked

    memory = load_config("balanced").memory
    default = PPOConfig(output_dir=str(tmp_path), report_to=[])
    assert asked(default, memory, deepspeed=False).free_cache is True
    keep = PPOConfig(output_dir=str(tmp_path), report_to=[], rollout_cache="keep")
    assert asked(keep, memory, deepspeed=False).free_cache is False
