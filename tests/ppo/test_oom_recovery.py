"""A CUDA out-of-memory error in PPO: split and retry, with the same result as a run without the OOM.

The OOM is injected (``tests/helpers/faults_train.py``) by a forward pre-hook that raises a real
``torch.OutOfMemoryError`` at chosen calls: gradient-tracking forwards of the policy's decoder for
training, no-grad ones for generation (policy) and scoring (value model). Every test compares with the
same run without the injection.
"""

from __future__ import annotations

import json

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.modeling import causal_lm_parts
from rapidfire_hf.ppo.seeds import sampling_generator
from tests.helpers.faults_train import only_during, oom_above_rows, oom_on_calls
from tests.ppo.helpers import ppo_args

# fp32 on CPU; only the summation order of the accumulated gradient differs between a split micro-batch
# and the whole one (measured: < 1e-8 with SGD, < 1e-7 after AdamW steps of 3e-6)
ATOL = 1e-6


def _build(tmp_path, tokenizer, optimizer="sgd", **kw):
    policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
    args = ppo_args(
        tmp_path, **{"num_ppo_epochs": 1, "num_mini_batches": 1, "learning_rate": 3e-6, "seed": 5, **kw}
    )
    extra = {}
    if optimizer == "sgd":
        # SGD, not Adam: Adam divides by sqrt(v), which turns summation-order rounding in a near-zero
        # gradient into a visible parameter difference; SGD keeps the comparison at rounding level.
        sgd = torch.optim.SGD([p for m in (policy, value) for p in m.parameters()], lr=0.1)
        extra["optimizers"] = (sgd, None)
    return PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        value_model=value,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
        **extra,
    )


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _train(tmp_path, tokenizer, max_rows=None, **kw):
    trainer = _build(tmp_path, tokenizer, **kw)
    oom = None
    if max_rows is not None:  # gradient-tracking forwards only: generation and scoring are left alone
        oom = oom_above_rows(causal_lm_parts(trainer.policy)[0], max_rows, grad=True)
    trainer.train()
    return trainer, _params(trainer), oom.raised if oom else 0


def test_split_micro_batches_give_the_same_update(tmp_path, tokenizer):
    _, reference, _ = _train(tmp_path / "ref", tokenizer)
    trainer, params, ooms = _train(tmp_path / "oom", tokenizer, max_rows=1)
    # per update: the first micro-batch of 4 rows OOMs, then its halves of 2 (2 splits); the later
    # micro-batch of the update is split down to single rows up front: 2 updates -> 4 splits
    assert ooms == 4 and trainer.state.log_history[-1]["rapidfire/oom_splits"] == 4
    for a, b in zip(reference, params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)


@pytest.mark.parametrize("config", ["balanced", "conservative"], ids=["pipeline-on", "pipeline-off"])
@pytest.mark.parametrize("call", [2, 1], ids=["closing-micro-batch", "first-micro-batch"])
def test_oom_split_gives_the_same_optimizer_steps_and_update(tmp_path, tokenizer, config, call):
    """2 micro-batches per window, 2 windows: an OOM in the forward of one micro-batch of the first
    window (call 2 closes it). The split must neither step the optimizer on a half (3 steps for 2
    windows, the pipeline applying a partial gradient) nor change the update."""
    # the user's split kept (memory.planner off): the rows below are the user's micro-batches
    cfg = {"preset": config, "memory": {"planner": False}}
    kw = dict(optimizer="rapidfire", rapidfire_config=cfg, max_grad_norm=0.0)
    reference = _build(tmp_path / "ref", tokenizer, **kw)
    reference.train()
    trainer = _build(tmp_path / "oom", tokenizer, **kw)
    # only PPO's training forwards count (the adaptive precision's calibration pass runs one before)
    oom = only_during(
        oom_on_calls(causal_lm_parts(trainer.policy)[0], [call], grad=True), trainer, "optimize"
    )
    trainer.train()

    opt, ref_opt = trainer.rapidfire_optimizer, reference.rapidfire_optimizer
    assert opt.pipeline_enabled == (config == "balanced")
    assert oom.raised == 1 and trainer.stepper.oom_splits == 1
    # the failed micro-batch ran again as 2 + 2 rows (and, when it was the first, the second one of its
    # update is split up front); the second update runs whole micro-batches again
    assert oom.rows == {2: [4, 4, 2, 2, 4, 4], 1: [4, 2, 2, 2, 2, 4, 4]}[call]
    assert opt.stats()["steps"] == ref_opt.stats()["steps"] == 2
    assert _adamw_steps(opt) == _adamw_steps(ref_opt) == {2}  # the inner AdamW stepped each parameter twice
    assert opt.stats()["pipelined_steps"] == ref_opt.stats()["pipelined_steps"]
    for a, b in zip(_params(reference), _params(trainer), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)


def test_oom_split_of_a_merged_forward_gives_the_same_update(tmp_path, tokenizer):
    """The planner puts both micro-batches of a window (4 + 4 rows) in one forward; an OOM in the second
    update's forward splits it back into 4 + 4, each normalised by its own micro-batch: the same update."""
    kw = dict(optimizer="rapidfire", rapidfire_config="balanced", max_grad_norm=0.0)
    reference = _build(tmp_path / "ref", tokenizer, **kw)
    reference.train()
    assert reference.plan.merge == 2
    trainer = _build(tmp_path / "oom", tokenizer, **kw)
    oom = only_during(oom_on_calls(causal_lm_parts(trainer.policy)[0], [2], grad=True), trainer, "optimize")
    trainer.train()
    assert oom.raised == 1 and oom.rows == [8, 8, 4, 4]
    assert trainer.rapidfire_optimizer.stats()["steps"] == reference.rapidfire_optimizer.stats()["steps"] == 2
    for a, b in zip(_params(reference), _params(trainer), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)


def _adamw_steps(opt) -> set[int]:
    """The step counts of the inner AdamW's parameters (one per optimizer step applied to each)."""
    return {int(state["step"]) for state in opt.inner.state.values()}


def test_gives_up_after_max_splits_with_a_message_naming_settings_that_act(tmp_path, tokenizer):
    with pytest.raises(RuntimeError, match=r"out of memory.*splitting the micro-batch 1 time") as err:
        _train(tmp_path, tokenizer, max_rows=0, max_oom_splits=1)
    message = str(err.value)
    for setting in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_oom_splits"):
        assert setting in message
    assert "memory.optimization" not in message


def test_telemetry_records_throughput_and_oom_splits(tmp_path, tokenizer, monkeypatch):
    """What `rapidfire monitor` reads: tokens/s per update and the OOM-split events."""
    from rapidfire_hf.memory import get_telemetry, telemetry

    # a writer of its own: the process-wide one may stream into an earlier test's (deleted) folder
    monkeypatch.setattr(telemetry, "_DEFAULT", None)
    monkeypatch.setenv("RAPIDFIRE_TELEMETRY_DIR", str(tmp_path / "telemetry"))
    _train(tmp_path, tokenizer, max_rows=2)
    # one stream per process (the first run of this pytest process chose its folder): read this run's tail
    lines = get_telemetry().path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    starts = [i for i, r in enumerate(records) if r["kind"] == "event" and r["name"] == "train_begin"]
    records = records[starts[-1] :]
    rates = [
        r["values"]["tokens_per_s"]
        for r in records
        if r["kind"] == "metrics" and "tokens_per_s" in r.get("values", {})
    ]
    splits = [r for r in records if r["kind"] == "event" and r["name"] == "oom_split"]
    assert len(rates) == 2 and all(v > 0 for v in rates)
    # one split per update: the first micro-batch of 4 rows OOMs, the later one is split up front
    assert sum(r["count"] for r in splits) == 2


# ---- generation and scoring ----------------------------------------------------------------------------


def _rollout(trainer, seed):
    torch.manual_seed(seed)
    return trainer.rollout(trainer.next_prompts(0))


def test_generation_oom_halves_the_chunk_and_draws_the_same_tokens(tmp_path, tokenizer, caplog):
    """8 prompts generated at once OOM (prefill of more than 2 rows): the chunk is halved twice and the
    RNG put back before each retry, so the tokens are those of a run generating 2 prompts at a time
    with the same seed (sampling draws per chunk, so that, not the 8-at-once draw, is the reference)."""
    trainer = _build(tmp_path, tokenizer)
    reference = _rollout(trainer, seed=11)  # the whole batch at once, no OOM
    trainer.args.rollout_generation_batch_size = 2
    small_chunks = _rollout(trainer, seed=11)
    trainer.args.rollout_generation_batch_size = None
    oom = oom_above_rows(causal_lm_parts(trainer.policy)[0], 2, grad=False)
    with caplog.at_level("WARNING", logger="rapidfire_hf.memory.oom"):
        recovered = _rollout(trainer, seed=11)
    oom.remove()
    assert oom.raised == 2  # 8 rows, then 4 rows
    assert sum("OOM in generation" in r.getMessage() for r in caplog.records) == 2
    assert recovered.responses.shape == reference.responses.shape
    assert torch.equal(recovered.responses, small_chunks.responses)
    torch.testing.assert_close(recovered.logprobs, small_chunks.logprobs, rtol=0, atol=0)
    assert not torch.equal(recovered.responses, reference.responses)  # the draw does depend on the chunk


def test_greedy_generation_oom_gives_the_tokens_of_the_run_without_it(tmp_path, tokenizer):
    trainer = _build(tmp_path, tokenizer)
    batch = trainer.next_prompts(0)
    reference = trainer.rollout(batch, sampling=False)
    oom = oom_above_rows(causal_lm_parts(trainer.policy)[0], 2, grad=False)
    recovered = trainer.rollout(batch, sampling=False)
    oom.remove()
    assert oom.raised == 2
    assert torch.equal(recovered.responses, reference.responses)
    # fp32 on CPU: a row's log-probs may differ at rounding level with the batch it is computed in
    torch.testing.assert_close(recovered.logprobs, reference.logprobs, rtol=0, atol=1e-6)


def test_generation_oom_mid_decode_restores_the_rng(tmp_path, tokenizer):
    """The second chunk of 4 prompts OOMs at its third decode step, after it drew tokens: the retry puts
    the sampling generator back, so its halves draw what a run generating them 2 at a time from there
    would."""
    trainer = _build(tmp_path, tokenizer, rollout_generation_batch_size=4)
    decoder = causal_lm_parts(trainer.policy)[0]
    probe = oom_above_rows(decoder, 10**9, grad=False)  # never raises: records the forwards' shapes
    _rollout(trainer, seed=3)
    probe.remove()
    prefills = [i for i, shape in enumerate(probe.shapes) if shape[1] > 1]
    assert len(prefills) == 2 and probe.rows[prefills[1]] == 4
    oom = oom_on_calls(decoder, [prefills[1] + 4], grad=False)  # 1-based: the third decode step
    recovered = _rollout(trainer, seed=3)
    oom.remove()
    assert oom.raised == 1

    # the rollout's noise comes from the update's generator (rapidfire_hf.ppo.seeds), drawn chunk by chunk
    generator = sampling_generator(trainer.args.seed, trainer.state.global_step)
    pieces = [
        trainer.roller.engine.generate(
            *_prompt_and_mask(trainer, a, b), _params_of(trainer), generator=generator
        )
        for a, b in ((0, 4), (4, 6), (6, 8))
    ]
    assert torch.equal(recovered.responses, torch.cat([p.responses for p in pieces]))


def _prompt_and_mask(trainer, start, stop):
    queries = trainer.next_prompts(0)["input_ids"][start:stop]
    return queries, queries != trainer.pad_token_id


def _params_of(trainer):
    from rapidfire_hf.rollout import SamplingParams

    args = trainer.args
    return SamplingParams(
        max_new_tokens=args.response_length,
        temperature=args.temperature + 1e-7,
        top_k=args.top_k,
        top_p=args.top_p,
        do_sample=True,
    )


def _value_backbone(trainer):
    value_model = trainer.accelerator.unwrap_model(trainer.model).value_model
    return getattr(value_model, value_model.base_model_prefix)


def test_scoring_oom_halves_the_forward_batch_and_gives_the_same_scores(tmp_path, tokenizer, caplog):
    trainer = _build(tmp_path, tokenizer, local_rollout_forward_batch_size=8)
    rollout = _rollout(trainer, seed=2)
    reference = trainer.score(rollout)
    value_backbone = _value_backbone(trainer)
    oom = oom_above_rows(value_backbone, 2, grad=False)
    with caplog.at_level("WARNING", logger="rapidfire_hf.memory.oom"):
        recovered = trainer.score(rollout)
    oom.remove()
    assert oom.raised == 2  # 8 rows, then 4
    assert sum("OOM in scoring" in r.getMessage() for r in caplog.records) == 2
    for field in ("values", "returns", "advantages", "logprobs", "rewards"):
        a, b = getattr(reference.adv, field), getattr(recovered.adv, field)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=field)


def test_scoring_oom_on_a_single_row_says_what_to_lower(tmp_path, tokenizer):
    trainer = _build(tmp_path, tokenizer, local_rollout_forward_batch_size=8)
    rollout = _rollout(trainer, seed=2)
    value_backbone = _value_backbone(trainer)
    oom_above_rows(value_backbone, 0, grad=False)
    with pytest.raises(RuntimeError, match="out of memory in scoring.*single row.*response_length"):
        trainer.score(rollout)
