"""A CUDA out-of-memory error in a PPO micro-batch: split, retry, same update, no sample dropped.

The OOM is raised by a forward pre-hook on the policy's decoder whenever a gradient-tracking forward
gets more rows than a limit (generation and scoring run without gradients and are left alone).
"""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.modeling import causal_lm_parts
from tests.ppo.helpers import ppo_args


def _train(tmp_path, tokenizer, max_rows=None, **kw):
    policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
    calls = {"oom": 0}
    if max_rows is not None:

        def fake_oom(module, args, kwargs):
            rows = kwargs["input_ids"].shape[0]
            if torch.is_grad_enabled() and rows > max_rows:
                calls["oom"] += 1
                raise torch.OutOfMemoryError(f"simulated: {rows} rows > {max_rows}")

        causal_lm_parts(policy)[0].register_forward_pre_hook(fake_oom, with_kwargs=True)
    args = ppo_args(
        tmp_path, **{"num_ppo_epochs": 1, "num_mini_batches": 1, "learning_rate": 3e-6, "seed": 5, **kw}
    )
    # SGD, not Adam: Adam divides by sqrt(v), which turns summation-order rounding in a near-zero
    # gradient into a visible parameter difference; SGD keeps the comparison at rounding level.
    sgd = torch.optim.SGD([p for m in (policy, value) for p in m.parameters()], lr=0.1)
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        value_model=value,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
        optimizers=(sgd, None),
    )
    trainer.train()
    return trainer, [p.detach().clone() for p in policy.parameters()], calls["oom"]


def test_split_micro_batches_give_the_same_update(tmp_path, tokenizer):
    _, reference, _ = _train(tmp_path / "ref", tokenizer)
    trainer, params, ooms = _train(tmp_path / "oom", tokenizer, max_rows=1)
    # 4 rows -> 2 + 2 -> 1+1+1+1: 3 splits per micro-batch, 2 micro-batches per update, 2 updates
    assert ooms > 0 and trainer.state.log_history[-1]["rapidfire/oom_splits"] == 12
    for a, b in zip(reference, params):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)  # only the summation order differs


def test_gives_up_after_max_splits_with_a_clear_message(tmp_path, tokenizer):
    with pytest.raises(RuntimeError, match="out of memory.*after 1 split.*per_device_train_batch_size"):
        _train(tmp_path, tokenizer, max_rows=0, max_oom_splits=1)


def test_telemetry_records_throughput_and_oom_splits(tmp_path, tokenizer):
    """What `rapidfire monitor` reads: tokens/s per update and the OOM-split events."""
    import json

    from rapidfire_hf.memory import get_telemetry

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
    assert sum(r["count"] for r in splits) == 4  # one split per micro-batch of 4 rows into 2 + 2
