"""Bad PPO input refused before any training step: PPOConfig fields, value mode, reward functions, datasets.

Each case says which field (or function, or dataset row) is wrong, the value, and what is allowed.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from datasets import Dataset

from rapidfire_hf.config import ConfigError
from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.data import prepare_prompt_dataset
from tests.ppo.helpers import ppo_args

NAN, INF = math.nan, math.inf

# (field, bad value, words of the allowed range the message must hold)
BAD_FIELDS = [
    # issue 16, item 9
    ("gradient_accumulation_steps", 0, "an integer >= 1"),
    ("num_mini_batches", 0, "an integer >= 1"),
    ("per_device_train_batch_size", 0, "an integer >= 1"),
    ("temperature", INF, "a finite number > 0"),
    ("kl_coef", NAN, "a finite number >= 0"),
    ("cliprange", -1, "a finite number > 0"),
    ("gamma", 2, "a number in [0, 1]"),
    ("vf_coef", INF, "a finite number >= 0"),
    ("max_prompt_length", 0, "an integer >= 1, or None"),
    ("max_prompt_length", -3, "an integer >= 1, or None"),
    ("total_episodes", 0, "an integer >= 1, or None"),
    ("total_episodes", -5, "an integer >= 1, or None"),
    ("max_oom_splits", -1, "an integer >= 0 and <= 64"),
    ("approx_kl_limit", -1, "a finite number > 0, or None"),
    # the sweep of every numeric / boolean field
    ("temperature", 0, "a finite number > 0"),
    ("temperature", "0.7", "a finite number > 0"),
    ("top_k", -1, "an integer >= 0"),
    ("top_p", 0, "a number in (0, 1]"),
    ("top_p", 1.5, "a number in (0, 1]"),
    ("top_p", NAN, "a number in (0, 1]"),
    ("lam", 1.5, "a number in [0, 1]"),
    ("lam", NAN, "a number in [0, 1]"),
    ("gamma", -0.1, "a number in [0, 1]"),
    ("cliprange", 0, "a finite number > 0"),
    ("cliprange", NAN, "a finite number > 0"),
    ("cliprange_value", -0.2, "a finite number > 0"),
    ("vf_coef", -1, "a finite number >= 0"),
    ("kl_coef", -0.1, "a finite number >= 0"),
    ("kl_coef", INF, "a finite number >= 0"),
    ("missing_eos_penalty", NAN, "a finite number >= 0, or None"),
    ("missing_eos_penalty", -1.0, "a finite number >= 0, or None"),
    ("num_ppo_epochs", 0, "an integer >= 1"),
    ("response_length", 0, "an integer >= 1"),
    ("response_length", True, "an integer >= 1"),
    ("local_rollout_forward_batch_size", 0, "'auto' (the planner chooses) or an integer >= 1"),
    ("num_sample_generations", -1, "an integer >= 0"),
    ("stop_token_id", -1, "an integer >= 0, or None"),
    ("reward_weights", [1.0, NAN], "a non-empty list of finite numbers"),
    ("reward_weights", [], "a non-empty list of finite numbers"),
    ("reward_weights", "1.0", "a non-empty list of finite numbers"),
    ("whiten_rewards", "False", "true or false"),
    ("memory_management", "no", "true or false"),
    ("max_oom_splits", 10**6, "an integer >= 0 and <= 64"),
    ("max_oom_splits", 1.5, "an integer >= 0 and <= 64"),
    ("approx_kl_limit", NAN, "a finite number > 0, or None"),
    ("approx_kl_limit", 0, "a finite number > 0, or None"),
    ("rollout_generation_batch_size", -1, "'auto' (the planner chooses) or an integer >= 1, or None"),
    ("num_mini_batches", 2.0, "an integer >= 1"),
    ("total_episodes", 1e4, "an integer >= 1, or None"),
    ("gradient_accumulation_steps", "2", "an integer >= 1"),
    ("dataset_text_field", "", "a non-empty string"),
    ("kl_estimator", "k2", "one of 'k1', 'k3'"),
    ("value_mode", "shared", "one of 'separate', 'fused'"),
    # TrainingArguments fields PPOTrainer reads
    ("learning_rate", NAN, "a finite number >= 0"),
    ("learning_rate", -1e-5, "a finite number >= 0"),
    ("max_grad_norm", NAN, "a finite number >= 0, or None"),
    ("max_grad_norm", -1.0, "a finite number >= 0, or None"),
    ("adam_beta1", 1.0, "a number in [0, 1)"),
    ("adam_beta2", -0.1, "a number in [0, 1)"),
    ("adam_epsilon", 0.0, "a finite number > 0"),
    ("weight_decay", NAN, "a finite number >= 0"),
    ("num_train_epochs", 0, "a finite number > 0"),
    ("max_steps", 0, "-1 (not set"),
    ("seed", -1, "an integer >= 0 and <= 4294967295"),
]


def _id(case):
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("field, value, allowed", BAD_FIELDS, ids=[_id(c) for c in BAD_FIELDS])
def test_bad_field_is_refused_naming_field_value_and_range(tmp_path, field, value, allowed):
    with pytest.raises(ConfigError) as info:
        ppo_args(tmp_path, **{field: value})
    message = str(info.value)
    assert f"{field}={value!r}: invalid value" in message, message
    assert f"allowed: {allowed}" in message, message
    assert info.value.key == field


# accepted on purpose: each is a meaningful setting
ACCEPTED = [
    ("kl_coef", 0.0),  # no KL penalty
    ("vf_coef", 0.0),  # the value model is not trained
    ("learning_rate", 0.0),  # a frozen run (debugging, measuring)
    ("max_grad_norm", 0.0),  # no clipping (as TRL)
    ("max_oom_splits", 0),  # never split on OOM
    ("top_k", 0),  # no top-k filter
    ("gamma", 0.0),  # only the immediate reward
    ("lam", 1.0),  # Monte-Carlo advantages
    ("cliprange", 100.0),  # effectively no clipping
    ("missing_eos_penalty", 0.0),
    ("reward_weights", [-1.0]),  # a penalty function
    ("total_episodes", 1),  # rounded up to one rollout batch
    ("max_steps", -1),
]


@pytest.mark.parametrize("field, value", ACCEPTED, ids=[_id(c) for c in ACCEPTED])
def test_meaningful_edge_values_are_accepted(tmp_path, field, value):
    assert getattr(ppo_args(tmp_path, **{field: value}), field) == value


def test_every_bad_field_is_listed_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        ppo_args(tmp_path, temperature=INF, kl_coef=NAN, gamma=2)
    assert [e.key for e in info.value.errors] == ["temperature", "kl_coef", "gamma"]
    assert str(info.value).count("\n  - ") == 3


def test_fused_value_mode_with_a_value_model_is_refused(tmp_path, tokenizer):
    with pytest.raises(ConfigError) as info:
        PPOTrainer(
            args=ppo_args(tmp_path, value_mode="fused"),
            processing_class=tokenizer,
            model=build_tiny_llama(tokenizer),
            value_model=build_tiny_value_model(tokenizer),
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(16),
        )
    message = str(info.value)
    assert info.value.key == "value_mode" and "'fused'" in message
    assert "drop value_model" in message and "value_mode='separate'" in message


def test_approx_kl_limit_without_a_rapidfire_optimizer_is_refused(tmp_path, tokenizer):
    with pytest.raises(ConfigError) as info:
        PPOTrainer(
            args=ppo_args(tmp_path, value_mode="fused", approx_kl_limit=0.1),
            processing_class=tokenizer,
            model=build_tiny_llama(tokenizer),
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(16),
        )  # the default AdamW cannot roll a step back: the limit would do nothing
    message = str(info.value)
    assert info.value.key == "approx_kl_limit" and "got 0.1" in message
    assert "RapidFireOptimizer" in message and "allowed: None with any optimizer" in message


def test_approx_kl_limit_with_a_rapidfire_config_is_accepted(tmp_path, tokenizer):
    trainer = PPOTrainer(
        args=ppo_args(tmp_path, value_mode="fused", approx_kl_limit=0.1, rapidfire_config="conservative"),
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
    )
    assert trainer.rapidfire_optimizer is not None


# ------------------------------------------------------------------------------------- reward functions
@pytest.fixture(scope="module")
def scorer(tmp_path_factory, tokenizer):
    """A trainer and a fake rollout of 4 completions, to call the reward-function scoring on."""
    from rapidfire_hf.ppo.types import Rollout

    trainer = PPOTrainer(
        args=ppo_args(tmp_path_factory.mktemp("rewards"), value_mode="fused"),
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
    )
    queries = torch.tensor([[5, 6, 7]] * 4)
    post = torch.tensor([[8, 9, 2]] * 4)
    rollout = Rollout(queries=queries, responses=post, logprobs=torch.zeros(4, 3), extra={})
    return trainer, rollout, post


def _score_with(scorer, func):
    trainer, rollout, post = scorer
    trainer.reward_funcs = [func]
    return trainer.scorer.reward_funcs_scores(rollout, post)


def dict_reward(completions, **kw):
    return {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}


def str_reward(completions, **kw):
    return "1234"


def matrix_reward(completions, **kw):
    return np.ones((4, 1))


def tensor_2d_reward(completions, **kw):
    return torch.ones(2, 2)


def generator_reward(completions, **kw):
    return (1.0 for _ in completions)


def none_reward(completions, **kw):
    return None


def short_reward(completions, **kw):
    return [1.0] * (len(completions) - 1)


def text_scores_reward(completions, **kw):
    return ["0.5"] * len(completions)


def nested_reward(completions, **kw):
    return [[1.0]] * len(completions)


BAD_REWARDS = [
    (dict_reward, TypeError, "a dict"),
    (str_reward, TypeError, "a str '1234'"),
    (matrix_reward, ValueError, "2-D ndarray of shape (4, 1)"),
    (tensor_2d_reward, ValueError, "2-D Tensor of shape (2, 2)"),
    (generator_reward, TypeError, "an iterator"),
    (none_reward, TypeError, "None"),
    (short_reward, ValueError, "3 scores for 4 completions"),
    (text_scores_reward, TypeError, "score 0 = '0.5' (str)"),
    (nested_reward, TypeError, "score 0 = [1.0] (list)"),
]


@pytest.mark.parametrize("func, error, words", BAD_REWARDS, ids=[f.__name__ for f, _, _ in BAD_REWARDS])
def test_bad_reward_values_name_the_function_and_expected_type(scorer, func, error, words):
    with pytest.raises(error) as info:
        _score_with(scorer, func)
    message = str(info.value)
    assert f"reward function '{func.__name__}' returned" in message, message
    assert words in message, message
    assert "a list (or 1-D tensor/array) of floats, one per completion" in message, message


GOOD_REWARDS = [
    lambda completions, **kw: [1, 2.5, True, np.float32(0.5)],
    lambda completions, **kw: (1.0, 2.0, 3.0, 4.0),
    lambda completions, **kw: torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True),
    lambda completions, **kw: np.arange(4),
    lambda completions, **kw: [torch.tensor(1.0)] * 4,
]


@pytest.mark.parametrize("func", GOOD_REWARDS, ids=["mixed", "tuple", "tensor", "array", "0-d"])
def test_good_reward_values_are_read_as_one_float_each(scorer, func):
    scores = _score_with(scorer, func)
    assert scores.shape == (4,) and scores.dtype == torch.float32


def test_bad_reward_function_stops_train_before_any_update(tmp_path, tokenizer):
    policy = build_tiny_llama(tokenizer)
    trainer = PPOTrainer(
        args=ppo_args(tmp_path, value_mode="fused"),
        processing_class=tokenizer,
        model=policy,
        reward_funcs=dict_reward,
        train_dataset=make_prompt_dataset(16),
    )
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(TypeError, match="reward function 'dict_reward' returned a dict"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


# --------------------------------------------------------------------------------------------- datasets
BAD_DATASETS = [
    ([], ValueError, "train_dataset is empty"),
    ({"prompt": "not a list"}, TypeError, "train_dataset is a dict but not of equal-length column lists"),
    ([1, 2], TypeError, "train_dataset is a list of int"),
    (42, TypeError, "train_dataset is a int; expected a datasets.Dataset"),
    (
        Dataset.from_dict({"prompt": ["a b", ""]}),
        ValueError,
        "train_dataset row 1: 'prompt' is an empty string",
    ),
    (Dataset.from_dict({"prompt": ["a b", None]}), TypeError, "train_dataset row 1: 'prompt' is None"),
    (Dataset.from_dict({"input_ids": [[5, 6], []]}), ValueError, "train_dataset row 1: 'input_ids' is empty"),
    (
        Dataset.from_dict({"input_ids": [[5.0, 6.0]]}),
        TypeError,
        "'input_ids' holds list<item: double>; expected lists of integer token ids",
    ),
]


@pytest.mark.parametrize(
    "data, error, words",
    BAD_DATASETS,
    ids=[
        "empty list",
        "dict of a string",
        "list of int",
        "int",
        "empty prompt",
        "None prompt",
        "empty input_ids",
        "float input_ids",
    ],
)
def test_bad_dataset_is_refused_naming_the_row(tokenizer, data, error, words):
    with pytest.raises(error) as info:
        prepare_prompt_dataset(data, tokenizer)
    assert words in str(info.value), str(info.value)


def test_dataset_dict_names_its_splits(tokenizer):
    from datasets import DatasetDict

    splits = DatasetDict({"train": make_prompt_dataset(4), "test": make_prompt_dataset(2)})
    with pytest.raises(TypeError, match=r"DatasetDict with splits \['train', 'test'\].*dataset\['train'\]"):
        prepare_prompt_dataset(splits, tokenizer)


@pytest.mark.parametrize(
    "data",
    [
        ["task: ab ->", "task: cd ->"],
        [{"prompt": "task: ab ->"}, {"prompt": "task: cd ->"}],
        {"prompt": ["task: ab ->", "task: cd ->"]},
    ],
    ids=["list of str", "list of dicts", "dict of columns"],
)
def test_plain_lists_and_dicts_become_datasets(tokenizer, data):
    ds = prepare_prompt_dataset(data, tokenizer)
    assert len(ds) == 2 and ds[0]["input_ids"] == tokenizer("task: ab ->")["input_ids"]


def _trainer_on(tmp_path, tokenizer, dataset, **overrides):
    return PPOTrainer(
        args=ppo_args(tmp_path, value_mode="fused", **overrides),
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),  # 256 positions
        reward_funcs=vowel_reward,
        train_dataset=dataset,
    )


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, tokenizer):
    rows = [[5, 6, 7]] * 7 + [[5, len(tokenizer) + 3]]
    with pytest.raises(ValueError) as info:
        _trainer_on(tmp_path, tokenizer, Dataset.from_dict({"input_ids": rows}))
    message = str(info.value)
    assert (
        f"row 7: token id {len(tokenizer) + 3} is outside the model's vocabulary [0, {len(tokenizer)})"
        in message
    )


def test_negative_token_ids_are_refused(tmp_path, tokenizer):
    rows = [[5, 6, 7]] * 7 + [[-1, 5]]
    with pytest.raises(ValueError, match=r"row 7: token id -1 is outside the model's vocabulary"):
        _trainer_on(tmp_path, tokenizer, Dataset.from_dict({"input_ids": rows}))


def test_prompts_longer_than_the_positions_are_refused(tmp_path, tokenizer):
    rows = [[5, 6, 7]] * 7 + [[5] * 251]  # 251 + 6 response tokens > 256 positions
    with pytest.raises(ValueError) as info:
        _trainer_on(tmp_path, tokenizer, Dataset.from_dict({"input_ids": rows}))
    message = str(info.value)
    assert "row 7: the prompt has 251 tokens, more than the 250" in message
    assert "max_prompt_length" in message


def test_max_prompt_length_makes_long_prompts_fit(tmp_path, tokenizer):
    rows = [[5, 6, 7]] * 7 + [[5] * 251]
    trainer = _trainer_on(tmp_path, tokenizer, Dataset.from_dict({"input_ids": rows}), max_prompt_length=32)
    assert max(len(r) for r in trainer.train_dataset["input_ids"]) == 32


def test_response_length_beyond_the_positions_is_refused(tmp_path, tokenizer):
    with pytest.raises(
        ValueError, match=r"response_length=300 leaves no room for a prompt in the model's 256"
    ):
        _trainer_on(tmp_path, tokenizer, make_prompt_dataset(16), response_length=300)


# ------------------------------------------------------------------------------------ RapidFireOptimizer
@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("grad_z_threshold", NAN, "must be a finite number > 0"),
        ("grad_z_threshold", -1.0, "must be a finite number > 0"),
        ("loss_z_threshold", "6", "must be a finite number > 0"),
        ("loss_z_threshold", INF, "must be a finite number > 0"),
        ("clip_headroom", NAN, "must be a finite number > 0"),
        ("warmup_steps", -1, "must be an int >= 0"),
        ("warmup_steps", 2.5, "must be an int >= 0"),
    ],
    ids=["grad_z=nan", "grad_z=-1", "loss_z='6'", "loss_z=inf", "headroom=nan", "warmup=-1", "warmup=2.5"],
)
def test_bad_optimizer_threshold_is_refused(name, value, allowed):
    from rapidfire_hf.optim import RapidFireOptimizer

    with pytest.raises(ValueError, match="^" + re.escape(f"{name}={value!r}: {allowed}")):
        RapidFireOptimizer(torch.nn.Linear(2, 2).parameters(), lr=1e-3, **{name: value})
