"""``PPOTrainer.save_model``: TRL 1.12's layout (policy at the top of output_dir), the value function beside
it, ``training_args.bin`` and a model card; ``push_to_hub`` fails clearly without a network."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rapidfire_hf import AutoModelForCausalLMWithValueHead
from tests.ppo.helpers import tiny_trainer


def _trained(tmp_path, tok, value_mode="separate", peft_config=None):
    trainer = tiny_trainer(
        tmp_path / "run", tok, value_mode=value_mode, max_steps=1, trainer_kwargs={"peft_config": peft_config}
    )
    trainer.train()
    return trainer, trainer.accelerator.unwrap_model(trainer.model)


def _same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_separate_value_model_layout(tmp_path, tokenizer, single_thread):
    trainer, module = _trained(tmp_path, tokenizer)
    out = tmp_path / "out"
    trainer.save_model(str(out), dataset_name="vowels")
    _same(AutoModelForCausalLM.from_pretrained(out).state_dict(), module.policy.state_dict())
    _same(AutoModelForSequenceClassification.from_pretrained(out / "value_model").state_dict(),
          module.value_model.state_dict())  # fmt: skip
    assert AutoTokenizer.from_pretrained(out).pad_token_id == tokenizer.pad_token_id
    assert (out / "training_args.bin").is_file()
    card = (out / "README.md").read_text()
    assert "separate value model" in card and "`kl_coef`" in card and "`vowels`" in card


def test_fused_head_loads_back_with_the_value_head_class(tmp_path, tokenizer, single_thread):
    trainer, module = _trained(tmp_path, tokenizer, value_mode="fused")
    out = tmp_path / "out"
    trainer.save_model(str(out))
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(out)
    _same(loaded.pretrained_model.state_dict(), module.policy.state_dict())
    _same(loaded.v_head.state_dict(), module.value_head.state_dict())
    assert not (out / "value_model").exists()


def test_lora_layout_is_the_adapter(tmp_path, tokenizer, single_thread):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, module = _trained(tmp_path, tokenizer, value_mode="fused", peft_config=lora)
    out = tmp_path / "out"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    head = torch.load(out / "pytorch_model.bin", weights_only=True)
    _same({k.removeprefix("v_head."): v for k, v in head.items()}, module.value_head.state_dict())


def test_push_to_hub_offline_names_the_repo(tmp_path, tokenizer, monkeypatch, single_thread):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer, _ = _trained(tmp_path, tokenizer)
    trainer.args.hub_model_id = "someone/ppo-test"
    with pytest.raises(RuntimeError, match="someone/ppo-test"):
        trainer.push_to_hub()
    assert (tmp_path / "run" / "config.json").is_file()  # saved before the upload was tried
