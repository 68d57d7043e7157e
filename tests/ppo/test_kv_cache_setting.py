"""``PPOConfig.rollout_kv_cache_dtype``: checked at the config boundary, handed to PPOTrainer's rollout engine,
counted by its plan, and refused by name at start wherever the rollout cannot keep an 8-bit cache.

On the CPU the static engine runs when asked (``rollout_backend="static"``), fp8 included, so the applied
path is tested here end to end; ``"auto"`` there runs ``model.generate``, which is refused.
"""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.kernels.kv_quant import SCALE_BYTES
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from tests.ppo.helpers import ppo_args


def _trainer(tmp_path, tokenizer, model=None, **overrides):
    args = ppo_args(tmp_path, value_mode="fused", max_steps=1, num_ppo_epochs=1, **overrides)
    return PPOTrainer(args=args, processing_class=tokenizer, model=model or build_tiny_llama(tokenizer),
                      reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(16))  # fmt: skip


def _keys(err: ConfigError) -> set:
    return {e.key for e in getattr(err, "errors", [err])}


@pytest.mark.parametrize("bad", ["bf16", "FP8", "int4", "", 8, True, None, torch.int8])
def test_a_bad_value_is_refused_by_name_with_the_allowed_ones(tmp_path, bad):
    with pytest.raises(ConfigError) as info:
        PPOConfig(output_dir=str(tmp_path), report_to=[], rollout_kv_cache_dtype=bad)
    text = str(info.value)
    assert "rollout_kv_cache_dtype" in text and "'auto', 'model', 'fp8', 'int8'" in text
    assert "Traceback" not in text


def test_a_bad_value_set_after_construction_is_refused_by_the_trainer(tmp_path, tokenizer):
    args = ppo_args(tmp_path, value_mode="fused")
    args.rollout_kv_cache_dtype = "int4"
    with pytest.raises(ConfigError, match="rollout_kv_cache_dtype") as info:
        PPOTrainer(args=args, processing_class=tokenizer, model=build_tiny_llama(tokenizer),
                   reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(16))  # fmt: skip
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}


def test_the_default_is_auto(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), report_to=[])
    assert args.rollout_kv_cache_dtype == "auto"


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_auto_on_the_cpu_runs_model_generate_and_an_8bit_cache_is_refused_at_start(tmp_path, tokenizer, kv):
    model = build_tiny_llama(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError) as info:
        _trainer(tmp_path, tokenizer, model, rollout_kv_cache_dtype=kv)
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}
    text = str(info.value)
    assert "native decode path" in text and "model.generate" in text and "rollout_backend='static'" in text
    assert all((a == b).all() for a, b in zip(before, model.parameters()))  # nothing moved or trained


def test_the_hf_backend_is_refused_by_name(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match=r"rollout_backend='hf' runs model\.generate") as info:
        _trainer(tmp_path, tokenizer, rollout_backend="hf", rollout_kv_cache_dtype="int8")
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}


def test_the_generic_path_is_refused_by_name(tmp_path, tokenizer):
    from tests.sweep.test_generic_path import tiny_opt

    with pytest.raises(ConfigError, match="generic path") as info:
        _trainer(
            tmp_path, tokenizer, tiny_opt(tokenizer), rollout_backend="static", rollout_kv_cache_dtype="fp8"
        )
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}


@pytest.mark.parametrize("asked", ["auto", "model"])
def test_the_models_dtype_is_accepted_on_every_path(tmp_path, tokenizer, asked):
    trainer = _trainer(tmp_path, tokenizer, rollout_kv_cache_dtype=asked)  # model.generate on the CPU
    trainer.train()
    assert trainer.roller.engine.backend == "hf" and trainer.roller.engine.kv_cache_dtype is None


def _held_cache(tmp_path, tokenizer, kv: str):
    trainer = _trainer(tmp_path / kv, tokenizer, rollout_backend="static", rollout_kv_cache_dtype=kv,
                       rapidfire_config="balanced")  # fmt: skip
    trainer.train()
    return trainer, trainer.roller.engine.held_bytes()


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_the_trainer_hands_the_8bit_cache_to_its_engine_and_its_plan(tmp_path, tokenizer, kv, capsys):
    model_dtype, held_full = _held_cache(tmp_path, tokenizer, "model")
    trainer, held_8bit = _held_cache(tmp_path, tokenizer, kv)
    engine = trainer.roller.engine
    assert (engine.backend, engine.path, engine.kv_cache_dtype) == ("static", "native", kv)
    # the cache itself: one byte an element plus an fp32 scale per head vector, against fp32 (4 bytes) here
    d = trainer.accelerator.unwrap_model(trainer.model).policy.config.head_dim
    assert held_8bit < held_full
    # the plan counts the same bytes per token as the engine holds
    full, small = model_dtype.plan, trainer.plan
    assert (full.kv_cache_dtype, small.kv_cache_dtype) == ("model dtype", kv)
    assert small.kv_bytes_per_token / full.kv_bytes_per_token == pytest.approx((d + SCALE_BYTES) / (4 * d))
    table = capsys.readouterr().out
    assert f"kv_cache_dtype={kv}" in table  # the start table's rollout line
    assert "KV cache dtype" in table and "your rollout_kv_cache_dtype" in table


@pytest.mark.parametrize(
    ("kv", "capability", "refused"),
    [
        ("fp8", (8, 0), True),  # A100: Triton compiles no e4m3 there (the attention kernel, torch.compile's)
        ("fp8", (8, 6), True),
        ("fp8", (8, 9), False),  # Ada
        ("fp8", (9, 0), False),  # Hopper
        ("int8", (8, 0), False),
        ("int8", (7, 5), False),
        ("fp8", None, False),  # not CUDA: torch's own fp8 casts run on the CPU
    ],
)
def test_fp8_is_refused_on_a_gpu_whose_triton_cannot_compile_it(tmp_path, tokenizer, kv, capability, refused):
    from rapidfire_hf.ppo.settings_check import kv_cache_refusal

    args = ppo_args(tmp_path, rollout_backend="static", rollout_kv_cache_dtype=kv)
    errors = kv_cache_refusal(args, build_tiny_llama(tokenizer), None, capability)
    assert bool(errors) == refused
    if refused:
        assert errors[0].key == "rollout_kv_cache_dtype" and "compute capability 8.9" in str(errors[0])
        assert "'int8' (any GPU)" in str(errors[0])


def test_the_trainer_asks_its_devices_capability(tmp_path, tokenizer, monkeypatch):
    from rapidfire_hf.ppo import settings_check

    monkeypatch.setattr(settings_check, "cuda_capability", lambda device: (8, 0))  # as on an A100
    with pytest.raises(ConfigError, match="this GPU is 8.0") as info:
        _trainer(tmp_path, tokenizer, rollout_backend="static", rollout_kv_cache_dtype="fp8")
    assert _keys(info.value) == {"rollout_kv_cache_dtype"}


@pytest.mark.usefixtures("single_thread")
def test_enable_rapidfire_on_a_ppo_trainer_plans_with_the_trainers_cache(tmp_path, tokenizer):
    """enable_rapidfire receives PPOConfig only inside a PPOTrainer (the contract's n/a): the trainer applied
    the field when built, and the plan the config then makes counts the 8-bit cache."""
    from rapidfire_hf import enable_rapidfire

    trainer = enable_rapidfire(
        _trainer(tmp_path, tokenizer, rollout_backend="static", rollout_kv_cache_dtype="int8"), "balanced"
    )
    trainer.train()
    assert trainer.roller.engine.kv_cache_dtype == "int8"
    assert trainer.plan.planned and trainer.plan.kv_cache_dtype == "int8"


def _auto_trainer(tmp_path, tokenizer, monkeypatch, level: str, choice=None):
    """A CPU run of ``rollout_kv_cache_dtype="auto"`` on the static engine at ``level``, planned as on a GPU
    (``kv_auto_unable`` says nothing stops an 8-bit cache), with ``choice`` in place of the plans' own."""
    from rapidfire_hf.ppo.recipe import planning

    monkeypatch.setattr(planning, "kv_auto_unable", lambda run, static: None)
    if choice is not None:
        monkeypatch.setattr(planning, "choose_kv_cache", lambda *a, **k: choice)
    trainer = _trainer(tmp_path, tokenizer, rollout_backend="static", rapidfire_config=level)
    trainer.train()
    return trainer


@pytest.mark.usefixtures("single_thread")
def test_auto_builds_the_engine_with_the_cache_its_plan_chose(tmp_path, tokenizer, monkeypatch, capsys):
    """memory.kv_choice: where the plan takes int8 for "auto", the rollout engine is built with it and the plan
    is the 8-bit one (its bytes per token); the choice's reason is the table's row."""
    from rapidfire_hf.memory.kv_choice import KVChoice
    from rapidfire_hf.memory.planner import kv_bytes_per_token

    trainer = _auto_trainer(tmp_path, tokenizer, monkeypatch, "aggressive", KVChoice("int8", "chosen here"))
    engine, plan = trainer.roller.engine, trainer.plan
    assert (engine.path, engine.kv_cache_dtype) == ("native", "int8")
    assert (plan.kv_cache_dtype, plan.asked["kv_cache_dtype"], plan.reasons["kv_cache_dtype"]) == (
        "int8", "auto", "chosen here"
    )
    config = trainer.accelerator.unwrap_model(trainer.model).policy.config
    itemsize = next(trainer.model.parameters()).element_size()
    assert plan.kv_bytes_per_token == kv_bytes_per_token(config, itemsize, "int8")
    assert "KV cache dtype               auto" in capsys.readouterr().out
    assert plan.metrics()["rapidfire/plan/kv_cache_8bit"] == 1


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize(
    ("level", "reason"),
    [
        # the tiny batch generates at once either way: 8 bits would take no fewer chunks
        ("aggressive", "auto, aggressive: the model's dtype (8 bits would generate in the same 1 chunk)"),
        ("balanced", "auto: the model's dtype; memory.optimization=balanced keeps the arithmetic"),
    ],
)
def test_auto_keeps_the_models_dtype_where_the_plans_say_so(tmp_path, tokenizer, monkeypatch, level, reason):
    trainer = _auto_trainer(tmp_path, tokenizer, monkeypatch, level)
    assert trainer.roller.engine.kv_cache_dtype is None
    assert trainer.plan.kv_cache_dtype == "model dtype"
    assert trainer.plan.reasons["kv_cache_dtype"].startswith(reason)
    assert trainer.plan.metrics()["rapidfire/plan/kv_cache_8bit"] == 0


def test_auto_on_the_cpu_says_why_it_keeps_the_models_dtype(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, rollout_backend="static", rapidfire_config="aggressive")
    trainer.train()
    assert trainer.roller.engine.kv_cache_dtype is None
    assert trainer.plan.reasons["kv_cache_dtype"] == "auto: the model's dtype (not a CUDA GPU)"
