"""PPOSweep and ``PPOConfig.rollout_kv_cache_dtype``: the batched decode keeps an 8-bit cache on the native
path (on any device: the sweep's "auto" runs the static engine wherever the model's family allows), its plan
counts the 8-bit bytes, and a run that cannot keep one is refused by name before any work."""

from __future__ import annotations

import pytest

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.kernels.kv_quant import SCALE_BYTES
from rapidfire_hf.sweep.spec import validate

from .helpers import make_sweep
from .test_generic_path import tiny_opt


def _keys(err: ConfigError) -> set:
    return {e.key for e in getattr(err, "errors", [err])}


@pytest.mark.usefixtures("single_thread")
def test_the_sweeps_decode_keeps_the_8bit_cache_and_its_plan_counts_it(tokenizer, tmp_path):
    plans = {}
    for kv in ("model", "int8"):
        sweep = make_sweep(tokenizer, tmp_path / kv, {"a": {}}, max_steps=1, rollout_kv_cache_dtype=kv,
                           rapidfire_config="balanced")  # fmt: skip
        engine = sweep.phases.engine
        assert (engine.backend, engine.path) == ("static", "native")
        assert engine.kv_cache_dtype == (None if kv == "model" else kv)
        if kv == "int8":
            sweep.train()  # one update decodes over the 8-bit cache, routed adapters and all
            assert sweep.phases.engine.held_bytes() > 0
        plans[kv] = sweep.planner.plan if kv == "int8" else sweep.plan()
    d = build_tiny_llama(tokenizer).config.head_dim
    assert plans["int8"].kv_cache_dtype == "int8" and plans["model"].kv_cache_dtype == "model dtype"
    # fp32 on the CPU: 4 bytes an element against one byte plus a 4-byte scale per head vector
    ratio = plans["int8"].kv_bytes_per_token / plans["model"].kv_bytes_per_token
    assert ratio == pytest.approx((d + SCALE_BYTES) / (4 * d))
    assert "KV cache dtype" in plans["int8"].table()


def test_the_hf_backend_is_refused_by_name(tokenizer, tmp_path):
    model = build_tiny_llama(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"rollout_backend='hf'") as info:
        make_sweep(
            tokenizer, tmp_path, {"a": {}}, model=model, rollout_backend="hf", rollout_kv_cache_dtype="fp8"
        )
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}
    assert all((a == b).all() for a, b in zip(before, model.parameters()))


def test_the_generic_path_is_refused_by_name(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="generic path") as info:
        make_sweep(tokenizer, tmp_path, {"a": {}}, model=tiny_opt(tokenizer), rollout_kv_cache_dtype="int8")
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}


@pytest.mark.parametrize("bad", ["int4", 8, None])
def test_a_bad_value_is_refused_by_name(tokenizer, tmp_path, bad):
    from rapidfire_hf.ppo import PPOConfig

    from .helpers import COMMON

    args = PPOConfig(output_dir=str(tmp_path), **COMMON)
    args.rollout_kv_cache_dtype = bad  # set after construction: the sweep checks it again
    from rapidfire_hf.demo import make_prompt_dataset, vowel_reward
    from rapidfire_hf.sweep import PPOSweep

    from .helpers import lora_config

    with pytest.raises(ConfigError, match="rollout_kv_cache_dtype") as info:
        PPOSweep(args=args, trials={"a": {}}, model=build_tiny_llama(tokenizer), processing_class=tokenizer,
                 reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(16), peft_config=lora_config(),
                 progress=False)  # fmt: skip
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}


def test_a_sweep_file_names_a_bad_value_and_a_trial_may_not_set_it():
    spec = {"model": "m", "dataset": "d", "reward_funcs": ["rapidfire_hf.demo:vowel_reward"],
            "trials": {"a": {}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"rollout_kv_cache_dtype='int4'.*'auto', 'model', 'fp8', 'int8'"):
        validate({**spec, "config": {"rollout_kv_cache_dtype": "int4"}})
    with pytest.raises(ConfigError, match="rollout_kv_cache_dtype"):
        validate({**spec, "trials": {"a": {"rollout_kv_cache_dtype": "int8"}}})
