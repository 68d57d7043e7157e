"""benchmarks/ppo_vs_trl, learning part: the configurations, the rule reward and the seed-mean curves."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmarks.loader import load_benchmark

run = load_benchmark("ppo_vs_trl/run.py", keep_on_path=True)
worker = load_benchmark("ppo_vs_trl/worker.py")


def test_learning_configs_give_every_system_the_same_ppo_settings():
    args = run.parse_args(
        ["--out", "x", "--part", "learning", "--learn-seeds", "0,3", "--learn-kl-coef", "0.02"]
    )
    rows = run.configs(args)
    assert [r["name"] for r in rows] == [
        f"learn_{s}_{m}_s{seed}"
        for seed in (0, 3)
        for s, m in (("trl", "separate"), ("rapidfire", "separate"), ("rapidfire", "fused"))
    ]
    shared = (
        "shape",
        "batch",
        "micro",
        "updates",
        "lr",
        "kl_coef",
        "target_mod",
        "temperature",
        "response_len",
    )
    assert len({tuple(r[k] for k in shared) for r in rows}) == 1
    # both trainers' configs are built from the same dict: same kl_coef, lr, epochs, one mini-batch
    common = worker.common_args({**rows[0], "part": "learning"}, "cpu")
    assert (common["kl_coef"], common["learning_rate"], common["num_ppo_epochs"]) == (0.02, args.learn_lr, 4)
    assert common["num_mini_batches"] == 1 and common["seed"] == 0
    assert run.SHAPES[args.learn_shape]["vocab_size"] == 64


def test_rule_reward_is_the_share_of_target_tokens_in_the_response():
    prompt_len, response_len, mod = 3, 5, 4
    reward = worker.RuleReward(prompt_len, response_len, mod)
    ids = torch.tensor([[8, 4, 9, 4, 8, 5, 12, 0], [5, 6, 7, 1, 2, 3, 4, 16]])
    mask = ids != 0  # pad (0) ends a response, as both trainers pass it
    hidden = getattr(reward, reward.base_model_prefix)(input_ids=ids, attention_mask=mask).hidden_states[-1]
    scores = reward.score(hidden)[:, -1, 0]
    expected = [
        sum(1 for t, m in zip(row[prompt_len:], keep[prompt_len:]) if m and t >= 4 and t % mod == 0)
        / response_len
        for row, keep in zip(ids.tolist(), mask.tolist())
    ]
    assert expected == [3 / 5, 2 / 5]  # specials (ids < 4) and the pad never score
    assert scores.tolist() == pytest.approx(expected)


def test_learning_curves_average_the_seeds_and_are_plotted(tmp_path):
    rows = []
    for seed, offset in ((0, 0.0), (1, 0.2)):
        for system, mode in run.LEARN_SYSTEMS:
            rewards = [0.25 + offset + 0.01 * i * (1 + (mode == "fused")) for i in range(8)]
            rows.append(
                dict(
                    part="learning",
                    status="ok",
                    shape="learn-tiny",
                    system=system,
                    value_mode=mode,
                    seed=seed,
                    target_mod=4,
                    rewards=rewards,
                    name=f"learn_{system}_{mode}_s{seed}",
                )
            )
    curves = run.learning_curves(rows)
    assert set(curves) == {"trl_separate", "rapidfire_separate", "rapidfire_fused"}
    for key, c in curves.items():
        runs = [r["rewards"] for r in rows if f"{r['system']}_{r['value_mode']}" == key]
        mean = [sum(v) / 2 for v in zip(*runs)]
        assert c["mean"] == pytest.approx(mean) and c["seeds"] == 2
        assert c["last5"] == pytest.approx(sum(mean[-5:]) / 5) and c["best"] == pytest.approx(max(mean))
        assert c["min"] == pytest.approx(runs[0]) and c["max"] == pytest.approx(runs[1])
    run.write_outputs(tmp_path, rows, {"command": "test"})
    summary = json.loads((tmp_path / "results.json").read_text())["learning_summary"]
    assert summary["rapidfire_fused"]["last"] == pytest.approx(curves["rapidfire_fused"]["last"])
    assert (tmp_path / "ppo_vs_trl.png").stat().st_size > 0


def test_learning_part_turns_our_gradient_clipping_off_like_trl():
    """TRL 1.12's PPO never clips; ours clips at max_grad_norm (TrainingArguments: 1.0) unless it is 0."""
    from rapidfire_hf import PPOConfig

    rows = run.configs(run.parse_args(["--out", "x", "--part", "learning", "--learn-seeds", "0"]))
    assert {r["max_grad_norm"] for r in rows} == {0.0}
    ours = PPOConfig(**worker.common_args({**rows[1], "name": "t"}, "cpu"))
    assert ours.max_grad_norm == 0.0
    rows = run.configs(
        run.parse_args(
            ["--out", "x", "--part", "learning", "--learn-seeds", "0", "--learn-max-grad-norm", "1"]
        )
    )
    assert worker.common_args({**rows[1], "name": "t"}, "cpu")["max_grad_norm"] == 1.0
    throughput = run.configs(run.parse_args(["--out", "x", "--part", "throughput"]))[0]
    assert "max_grad_norm" not in worker.common_args(throughput, "cpu")  # the timed parts: as shipped


def test_rule_reward_records_response_lengths_and_pad_draws():
    reward = worker.RuleReward(2, 4, 4)
    backbone = getattr(reward, reward.base_model_prefix)
    ids = torch.tensor([[5, 6, 8, 9, 10, 11], [5, 6, 0, 8, 8, 8], [5, 6, 8, 8, 0, 0]])
    backbone(input_ids=ids, attention_mask=ids != 0)
    assert backbone.seen == []  # off unless the learning part turns it on
    backbone.record = True
    backbone(input_ids=ids, attention_mask=ids != 0)
    # tokens before the first pad: 4, 0, 2; rows with a pad: 2 of 3; a pad first: 1 of 3
    assert backbone.seen == [pytest.approx({"response_length": 2.0, "pad_rows": 2 / 3, "pad_first": 1 / 3})]


def test_learn_dtype_sets_both_trainers_weights_and_mixed_precision():
    """`--learn-dtype bf16` on the CPU builds bf16 models with bf16=True (the GPU's numerics); auto keeps
    the device default (fp32 on the CPU, bf16 on the GPU)."""
    for flag, cpu_dtype, gpu_dtype in (
        ("auto", torch.float32, torch.bfloat16),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp32", torch.float32, torch.float32),
    ):
        args = run.parse_args(
            ["--out", "x", "--part", "learning", "--learn-seeds", "0", "--learn-dtype", flag]
        )
        cfg = {**run.configs(args)[0], "shape_kwargs": run.SHAPES["learn-tiny"]}
        assert cfg["dtype"] == flag
        assert worker.model_dtype(cfg, "cpu") == cpu_dtype and worker.model_dtype(cfg, "cuda") == gpu_dtype
        assert worker.common_args(cfg, "cpu")["bf16"] == (cpu_dtype == torch.bfloat16)
    policy, ref, value, _ = worker.build_models(cfg | {"dtype": "bf16"}, "cpu")
    assert {p.dtype for m in (policy, ref, value) for p in m.parameters()} == {torch.bfloat16}
    with pytest.raises(SystemExit):  # argparse refuses an unknown dtype
        run.parse_args(["--out", "x", "--learn-dtype", "fp16"])
