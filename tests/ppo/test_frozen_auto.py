"""PPOTrainer with ref_model_quantization / reward_model_quantization="auto": planned for the card at construction
(rapidfire_hf.ppo.recipe.frozen_auto), the same choice as `rapidfire plan --frozen-quantization auto`, said once
in the start table; refused by name where it cannot apply (PPOSweep) and for values that are not allowed."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama, build_tiny_value_model
from rapidfire_hf.memory.planner import GIB
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from rapidfire_hf.ppo.quantized import is_quantized
from rapidfire_hf.ppo.recipe import frozen_auto
from rapidfire_hf.utils.imports import is_available
from tests.ppo.helpers import ppo_args

needs_bnb = pytest.mark.skipif(not is_available("bitsandbytes"), reason="bitsandbytes not installed")
PROMPT = 6  # tokens per prompt of the dataset below (the plan's prompt length)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _data(n=16):
    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"input_ids": torch.randint(4, 40, (n, PROMPT), generator=g).tolist()})


def _trainer(tmp_path, tok, config=None, peft_config=None, reward=True, **kw):
    args = ppo_args(tmp_path, value_mode="fused", rapidfire_config=config, gradient_accumulation_steps=1,
                    num_mini_batches=1, **kw)  # fmt: skip
    return PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_tiny_llama(tok),
        reward_model=build_tiny_value_model(tok, seed=5) if reward else None,
        reward_funcs=None if reward else (lambda completions, **k: [0.0] * len(completions)),
        train_dataset=_data(),
        peft_config=peft_config,
    )


AUTO = dict(ref_model_quantization="auto", reward_model_quantization="auto")


def _card_where_8bit_pays(tok, tmp_path) -> int:
    """A card (bytes) on which the tiny run's plan as given makes a trade 8-bit frozen models spare."""
    from rapidfire_hf.memory.frozen_choice import plan_frozen
    from rapidfire_hf.ppo.recipe.planning import asked

    args = ppo_args(tmp_path, value_mode="fused", gradient_accumulation_steps=1, num_mini_batches=1, **AUTO)
    run = frozen_auto.trainer_run_shape(args, build_tiny_llama(tok), object(), False, PROMPT)
    from rapidfire_hf.config import load_config

    want = asked(args, load_config("aggressive").memory, deepspeed=False)
    for kib in range(256, 64 * 1024, 64):
        choice = plan_frozen(run, kib << 10, "aggressive", asked=want, host_offload=args.host_offload)
        if choice.bits == "8bit":
            return kib << 10
    raise AssertionError("no card size where 8-bit frozen models pay for the tiny run")


@pytest.mark.parametrize("value", ["AUTO", 8, "int8", True])
def test_values_that_are_not_allowed_are_refused_naming_the_field_and_the_choices(tmp_path, value):
    for name in ("ref_model_quantization", "reward_model_quantization"):
        with pytest.raises((ConfigError, ValueError)) as err:
            ppo_args(tmp_path, **{name: value})
        text = str(err.value)
        assert name in text and "'auto'" in text and "'8bit'" in text, text


def test_auto_without_a_config_keeps_them_as_given_and_says_why(tmp_path, tok, capsys):
    trainer = _trainer(tmp_path, tok, max_steps=1, **AUTO)
    assert trainer.frozen_choice.bits is None and "no rapidfire config" in trainer.frozen_choice.reason
    assert not is_quantized(trainer.ref_model) and not is_quantized(trainer.reward_model)
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("frozen models: as given (auto: no rapidfire config") == 1, out


@pytest.mark.parametrize("level", ["conservative", "balanced"])
def test_auto_under_a_level_that_does_not_allow_it_is_said_not_silent(tmp_path, tok, monkeypatch, level):
    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: 1 << 20)  # a card too small for anything
    trainer = _trainer(tmp_path, tok, config=level, **AUTO)
    assert trainer.frozen_choice.bits is None and not is_quantized(trainer.ref_model)
    assert f"memory.optimization={level} keeps their arithmetic" in trainer.frozen_choice.line()


def test_auto_on_the_cpu_has_no_card_to_plan_for(tmp_path, tok):
    trainer = _trainer(tmp_path, tok, config="aggressive", **AUTO)
    assert trainer.frozen_choice.bits is None and "no GPU to plan for" in trainer.frozen_choice.reason


@needs_bnb
def test_auto_under_aggressive_quantizes_where_the_plan_pays_and_the_table_says_it(tmp_path, tok, monkeypatch,
                                                                                  capsys):  # fmt: skip
    card = _card_where_8bit_pays(tok, tmp_path)
    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: card)
    trainer = _trainer(tmp_path, tok, config="aggressive", max_steps=1, **AUTO)
    assert trainer.frozen_choice.bits == "8bit", trainer.frozen_choice
    assert is_quantized(trainer.ref_model) and is_quantized(trainer.reward_model)
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("frozen models: 8bit (auto, aggressive: the plan as given ") == 1, out  # start table
    row = [line for line in out.splitlines() if line.strip().startswith("frozen models  ")]
    assert len(row) == 1 and "8bit" in row[0] and "auto, aggressive" in row[0], out  # the plan table's row
    # a field given explicitly keeps its value beside "auto"
    trainer = _trainer(tmp_path, tok, config="aggressive", ref_model_quantization="auto")
    assert not is_quantized(trainer.reward_model)
    assert is_quantized(trainer.ref_model) == (trainer.frozen_choice.bits is not None)
    # a card with room to spare: as given
    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: 80 * GIB)
    trainer = _trainer(tmp_path, tok, config="aggressive", **AUTO)
    assert trainer.frozen_choice.bits is None and not is_quantized(trainer.ref_model)
    assert "the plan fits; 8 or 4 bits would spare none of its trades" in trainer.frozen_choice.reason


def test_auto_with_a_lora_reference_keeps_the_adapter_disabled_policy(tmp_path, tok, monkeypatch):
    from peft import LoraConfig

    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: 1 << 20)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = _trainer(tmp_path, tok, config="aggressive", peft_config=lora, reward=False,
                       ref_model_quantization="auto")  # fmt: skip
    assert trainer.ref_model is None  # the adapter-disabled policy is the reference
    assert "no separate frozen model" in trainer.frozen_choice.reason
    # an explicit precision with LoRA is still refused by name
    with pytest.raises(ValueError, match="ref_model_quantization='8bit' with LoRA"):
        _trainer(tmp_path, tok, peft_config=lora, reward=False, ref_model_quantization="8bit")


@needs_bnb
def test_the_cli_plans_the_same_run_as_the_trainer(tmp_path, tok, monkeypatch, capsys):
    """`rapidfire plan --model DIR --gpu-memory G --config aggressive --reward model --frozen-quantization auto`
    chooses what the trainer chooses for the same settings on a card of G, at cards where it differs."""
    from rapidfire_hf.cli.main import main

    model_dir = tmp_path / "policy"
    build_tiny_llama(tok).config.save_pretrained(model_dir)
    pays = _card_where_8bit_pays(tok, tmp_path)
    seen = set()
    for card in (pays, 64 * GIB):
        monkeypatch.setattr(frozen_auto, "card_bytes", lambda device, card=card: card)
        trainer = _trainer(tmp_path, tok, config="aggressive", **AUTO)
        flags = ["plan", "--model", str(model_dir), "--gpu-memory", repr(card / GIB), "--config", "aggressive",
                 "--reward", "model", "--frozen-quantization", "auto", "--batch", "4", "--micro", "4",
                 "--prompt-length", str(PROMPT), "--response-length", "6", "--json"]  # fmt: skip
        main(flags)
        plan = json.loads(capsys.readouterr().out)
        assert plan["frozen"] == trainer.frozen_choice.label
        assert plan["reasons"]["frozen_quantization"] == trainer.frozen_choice.reason
        seen.add(plan["frozen"])
    assert seen == {"8bit", "as given"}


def test_the_sweep_refuses_auto_by_name(tmp_path):
    from rapidfire_hf.ppo.settings_check import check_sweep_settings

    for name in ("ref_model_quantization", "reward_model_quantization"):
        args = PPOConfig(output_dir=str(tmp_path), value_mode="fused", **{name: "auto"})
        with pytest.raises(ConfigError) as err:
            check_sweep_settings(args)
        keys = {e.key for e in getattr(err.value, "errors", [err.value])}
        assert keys == {name} and "PPOSweep does not apply it" in str(err.value), str(err.value)


@needs_bnb
def test_a_config_applied_to_a_built_trainer_says_what_its_plan_would_choose(tmp_path, tok, monkeypatch):
    """enable_rapidfire(trainer, config) after construction: the frozen models stay as built, and where the
    config's plan would choose otherwise the start table says so (not a silent stale reason)."""
    from rapidfire_hf import enable_rapidfire

    card = _card_where_8bit_pays(tok, tmp_path)
    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: card)
    trainer = _trainer(tmp_path, tok, **AUTO)
    assert trainer.frozen_choice.bits is None
    enable_rapidfire(trainer, "aggressive")
    assert trainer.frozen_choice.bits is None and not is_quantized(trainer.ref_model)
    assert "whose plan would choose 8bit" in trainer.frozen_choice.reason, trainer.frozen_choice
    trainer = _trainer(tmp_path, tok, **AUTO)
    enable_rapidfire(trainer, "balanced")  # the same choice: its own reason
    assert "memory.optimization=balanced keeps their arithmetic" in trainer.frozen_choice.reason


def test_auto_with_hf_checkpointing_plans_without_a_traceback(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: 80 * GIB)
    trainer = _trainer(tmp_path, tok, config="aggressive", gradient_checkpointing=True, **AUTO)
    assert trainer.frozen_choice.bits is None and "the plan fits" in trainer.frozen_choice.reason


@pytest.mark.parametrize("kv", ["auto", "model"])
def test_the_trainer_plans_frozen_auto_with_the_kv_cache_auto_chooses(tmp_path, tok, monkeypatch, kv):
    """With ``rollout_kv_cache_dtype="auto"`` (the default) the frozen models' plan is made on the run with
    the cache "auto" chooses (``memory.kv_choice.run_with_kv_choice``, the policy's own reason when its decode
    cannot read 8 bits); a cache the user names is planned as named."""
    seen = []
    real = frozen_auto.run_with_kv_choice

    def spy(run, card, level, reason=None, **kw):
        seen.append((run.kv_cache_dtype, level, reason))
        return real(run, card, level, reason, **kw)

    monkeypatch.setattr(frozen_auto, "run_with_kv_choice", spy)
    monkeypatch.setattr(frozen_auto, "card_bytes", lambda device: 80 * GIB)
    _trainer(tmp_path, tok, config="aggressive", rollout_kv_cache_dtype=kv, **AUTO)
    assert seen == ([(None, "aggressive", None)] if kv == "auto" else []), seen
