"""Issue 43's examples of settings accepted and not applied: each one now applied or refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.integrations.enable import check_call_arguments
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from tests.ppo.helpers import ppo_args
from tests.sweep.helpers import make_sweep


def _trainer(args, tokenizer, model=None, **kw):
    return PPOTrainer(args=args, processing_class=tokenizer, model=model or build_tiny_llama(tokenizer),
                      reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(16), **kw)  # fmt: skip


def _keys(err) -> set:
    return {e.key for e in getattr(err, "errors", [err])}


# ------------------------------------------------------------------------------------------ PPOSweep
def test_sweep_refuses_value_mode_separate_by_name(tokenizer, tmp_path):
    with pytest.raises(ConfigError) as info:
        make_sweep(tokenizer, tmp_path, {"a": {}}, value_mode="separate")
    assert _keys(info.value) == {"value_mode"} and "fused" in str(info.value)


def test_sweep_runs_the_hf_backend_when_asked_and_says_so_in_the_summary(tokenizer, tmp_path):
    sweep = make_sweep(tokenizer, tmp_path, {"a": {}}, rollout_backend="hf", max_steps=1)
    assert sweep.phases.engine.backend == "hf"
    sweep.train()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rollout_backend"] == "hf"


def test_sweep_default_backend_is_the_static_engine(tokenizer, tmp_path):
    assert make_sweep(tokenizer, tmp_path, {"a": {}}).phases.engine.backend == "static"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("approx_kl_limit", 0.1),
        ("ref_model_quantization", "8bit"),
        ("rollout_decode_fuse_lora", True),
        ("num_sample_generations", 3),
        ("gradient_checkpointing", True),
        ("optim", "sgd"),
        ("rollout_generation_batch_size", 4),
    ],
)
def test_sweep_refuses_what_it_does_not_apply_by_name(tokenizer, tmp_path, field, value):
    with pytest.raises(ConfigError) as info:
        make_sweep(tokenizer, tmp_path, {"a": {}}, **{field: value})
    assert _keys(info.value) == {field}, str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the sweep autocasts on CUDA")
@pytest.mark.parametrize("field", ["bf16", "fp16"])
def test_sweep_bf16_on_the_cpu_is_refused(tokenizer, tmp_path, field):
    with pytest.raises(ConfigError) as info:
        make_sweep(tokenizer, tmp_path, {"a": {}}, **{field: True})
    assert _keys(info.value) == {field} and "CUDA" in str(info.value)


def test_sweep_refuses_a_rapidfire_config_field_it_does_not_apply(tokenizer, tmp_path):
    with pytest.raises(ConfigError) as info:
        make_sweep(tokenizer, tmp_path, {"a": {}}, rapidfire_config={"gradient": {"sync_interval": 4}})
    assert _keys(info.value) == {"gradient.sync_interval"}
    # the memory level is applied: accepted
    make_sweep(tokenizer, tmp_path, {"a": {}}, rapidfire_config={"memory": {"optimization": "aggressive"}})


# ------------------------------------------------------------------------------------------ PPOTrainer
def test_trainer_refuses_precision_bf16_while_computing_in_fp32(tokenizer, tmp_path):
    with pytest.raises(ConfigError) as info:
        _trainer(ppo_args(tmp_path, value_mode="fused", rapidfire_config={"precision": "bf16"}), tokenizer)
    assert info.value.key == "precision.initial" and "fp32" in str(info.value)
    trainer = _trainer(ppo_args(tmp_path, value_mode="fused", bf16=True, rapidfire_config={"precision": "bf16"}),
                       tokenizer)  # fmt: skip
    assert trainer.accelerator.mixed_precision == "bf16"  # asked for where it applies: computes in bf16


def test_start_table_says_the_capped_sync_interval_and_the_rewritten_clip_prediction(tokenizer, tmp_path, capsys):
    cfg = {"gradient": {"sync_interval": 100, "clip_prediction": "scale"}, "precision": {"mode": "static", "initial": "fp32"}}
    args = ppo_args(tmp_path, value_mode="fused", max_grad_norm=0.0, max_steps=1, rapidfire_config=cfg)
    trainer = _trainer(args, tokenizer)
    trainer.train()
    out = capsys.readouterr().out
    steps = args.num_ppo_epochs * args.num_mini_batches
    assert f"gradient.sync_interval=100 runs as {steps}" in out
    assert "gradient.clip_prediction=scale runs as exact" in out
    assert trainer.rapidfire_optimizer.sync_interval == steps  # what the table says is what runs
    assert out.count("gradient.sync_interval=100") == 1  # said once


def test_start_table_says_the_presets_precision_is_not_what_runs(tokenizer, tmp_path, capsys):
    trainer = _trainer(ppo_args(tmp_path, value_mode="fused", max_steps=1, rapidfire_config="balanced"), tokenizer)
    trainer.train()
    assert "precision: computes in fp32" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["aggressive", "fastest"])
def test_memory_variables_without_a_rapidfire_config_are_refused_by_name(tokenizer, tmp_path, monkeypatch, value):
    monkeypatch.setenv("RAPIDFIRE_MEMORY_OPTIMIZATION", value)
    with pytest.raises(ConfigError) as info:
        _trainer(ppo_args(tmp_path, value_mode="fused"), tokenizer)
    assert "RAPIDFIRE_MEMORY_OPTIMIZATION" in str(info.value)
    with pytest.raises(ConfigError, match="RAPIDFIRE_MEMORY_OPTIMIZATION"):
        make_sweep(tokenizer, tmp_path, {"a": {}})


def test_memory_variable_with_a_rapidfire_config_is_applied(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_MEMORY_OPTIMIZATION", "aggressive")
    cfg = {"precision": {"mode": "static", "initial": "fp32"}}
    trainer = _trainer(ppo_args(tmp_path, value_mode="fused", rapidfire_config=cfg), tokenizer)
    assert trainer.rf_config.memory.optimization.value == "aggressive"


@pytest.mark.parametrize("name,value", [("RAPIDFIRE_SYNC_INTERVAL", "often"), ("RAPIDFIRE_SYNC_THRESHOLD", "nan"),
                                        ("RAPIDFIRE_SYNC_DEBUG", "maybe")])  # fmt: skip
def test_bad_sync_debug_variables_are_refused_by_name(tokenizer, tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        _trainer(ppo_args(tmp_path, value_mode="fused"), tokenizer)


def test_a_field_changed_after_construction_is_checked_by_the_trainer(tokenizer, tmp_path):
    args = ppo_args(tmp_path, value_mode="fused")
    args.num_mini_batches = 3  # 8 prompts per batch do not split into 3 (was an IndexError in training)
    with pytest.raises(ConfigError, match="num_mini_batches"):
        _trainer(args, tokenizer)
    args.num_mini_batches = 2
    args.eval_strategy = "steps"  # a refused field set after construction is refused too
    with pytest.raises(ConfigError) as info:
        _trainer(args, tokenizer)
    assert _keys(info.value) == {"eval_strategy"}


def test_a_field_changed_after_the_trainer_was_built_is_refused_at_train(tokenizer, tmp_path):
    args = ppo_args(tmp_path, value_mode="fused")
    trainer = _trainer(args, tokenizer)
    args.kl_coef = 0.5
    with pytest.raises(ConfigError, match="kl_coef"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_static_backend_for_a_model_it_cannot_run_is_refused_before_the_start_table(tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    # the sweep's batched decode takes the generic path as the trainer's engine does: GPT-2 passes the settings
    # check, and its Conv1D projections are then refused by the adapter bank, naming the workaround
    with pytest.raises(ValueError, match="Conv1D .*PPOTrainer"):
        _sweep_gpt2(tokenizer, tmp_path, gpt2)
    gpt2._can_compile_fullgraph = False  # now neither the native nor the generic forward runs it
    with pytest.raises(ConfigError) as info:
        _trainer(ppo_args(tmp_path, value_mode="fused", rollout_backend="static"), tokenizer, gpt2)
    assert info.value.key == "rollout_backend" and "gpt2" in str(info.value)


def _sweep_gpt2(tokenizer, tmp_path, model):
    from peft import LoraConfig

    from rapidfire_hf.sweep import PPOSweep

    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], rollout_backend="static", value_mode="fused")
    return PPOSweep(args=args, trials={"a": {}}, model=model, processing_class=tokenizer,
                    train_dataset=make_prompt_dataset(16), reward_funcs=vowel_reward,
                    peft_config=LoraConfig(r=2, target_modules=["c_attn"]), progress=False)  # fmt: skip


# ------------------------------------------------------------------------------------------ enable_rapidfire
@pytest.mark.parametrize("value", [-5, math.nan, math.inf, "fast", True, 0])
def test_enable_rapidfire_refuses_a_bad_peak_flops_by_name(value):
    with pytest.raises(ValueError, match="peak_flops"):
        check_call_arguments(True, value)


@pytest.mark.parametrize("value", [1, 0, 1.0, "yes", None])
def test_enable_rapidfire_refuses_a_rollout_that_is_not_a_choice(value):
    with pytest.raises(ValueError, match="rollout"):
        check_call_arguments(value, None)


def test_enable_rapidfire_accepts_its_choices():
    for rollout in (True, False, "auto", "static", "hf"):
        check_call_arguments(rollout, 989e12)


def test_enable_rapidfire_call_refuses_before_touching_the_trainer(tokenizer, tmp_path):
    from rapidfire_hf.integrations.enable import enable_rapidfire

    trainer = _trainer(ppo_args(tmp_path, value_mode="fused"), tokenizer)
    for kwargs in ({"peak_flops": -5}, {"rollout": 1}):
        with pytest.raises(ValueError):
            enable_rapidfire(trainer, **kwargs)
    assert not trainer.rapidfire_config_applied


# ------------------------------------------------------------------------------------------ found attacking
@pytest.mark.parametrize("field,value", [("bf16", 1), ("use_cpu", 0), ("push_to_hub", "no"), ("whiten_rewards", "yes"),
                                         ("gradient_checkpointing", 1)])  # fmt: skip
def test_a_bool_field_takes_a_bool_only(field, value):
    with pytest.raises(ConfigError) as info:
        PPOConfig(output_dir="x", report_to=[], **{field: value})
    assert _keys(info.value) == {field}


def test_a_sweep_file_is_refused_at_validation_before_any_model_loads(tmp_path):
    from rapidfire_hf.sweep.spec import validate

    doc = {"reward_funcs": ["demo"], "config": {"output_dir": str(tmp_path), "value_mode": "separate"},
           "trials": {"a": {"kl_coef": 0.1}}}  # fmt: skip
    with pytest.raises(ConfigError, match="value_mode"):
        validate(doc)


def test_decode_options_model_generate_cannot_use_are_said_in_the_start_table(tokenizer, tmp_path, capsys):
    args = ppo_args(tmp_path, value_mode="fused", max_steps=1, rollout_backend="hf", rollout_decode_sampler="triton",
                    rollout_decode_mode="eager")  # fmt: skip
    _trainer(args, tokenizer).train()
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "rollout_decode_mode=eager" in x)
    assert "rollout_decode_sampler=triton" in line and "model.generate" in line and line.strip().startswith("skipped")


def test_a_precision_asked_by_environment_is_refused_where_it_does_not_run(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_PRECISION_INITIAL", "bf16")
    args = ppo_args(tmp_path, value_mode="fused", rapidfire_config={"precision": {"mode": "static"}})
    with pytest.raises(ConfigError, match="RAPIDFIRE_PRECISION_INITIAL") as info:
        _trainer(args, tokenizer)
    assert info.value.key == "precision.initial"
    # a full-form template (config/advanced.yaml lists every key) is said in the start table instead
    monkeypatch.delenv("RAPIDFIRE_PRECISION_INITIAL")
    _trainer(ppo_args(tmp_path, value_mode="fused", rapidfire_config="config/advanced.yaml"), tokenizer)


def test_the_bool_check_survives_hf_argument_parser_rewriting_field_types():
    """HfArgumentParser sets Field.type of `str | bool` fields to bool in place; 'no' stays valid."""
    from transformers import HfArgumentParser

    HfArgumentParser(PPOConfig)
    assert PPOConfig(output_dir="x", report_to=[]).include_num_input_tokens_seen == "no"
