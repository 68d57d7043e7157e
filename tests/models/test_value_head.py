"""Value-head models in TRL's checkpoint format and the TRL-named PPO helpers, on tiny local models."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, T5Config, T5ForConditionalGeneration

from rapidfire_hf import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead
from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.ppo.compat import batch_generation, masked_mean, masked_var, masked_whiten


@pytest.fixture()
def causal_dir(tmp_path, tokenizer):
    path = tmp_path / "causal"
    build_tiny_llama(tokenizer).save_pretrained(path)
    return str(path)


@pytest.fixture()
def seq2seq_dir(tmp_path):
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    path = tmp_path / "t5"
    T5ForConditionalGeneration(config).save_pretrained(path)
    return str(path)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_head_shape_init_and_dropout(causal_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir)
    assert model.v_head.summary.weight.shape == (1, model.config.hidden_size)
    assert model.v_head.summary.bias.abs().sum() > 0  # default Linear init, as TRL's default strategy
    assert model.v_head.dropout.p == 0.1
    assert (
        AutoModelForCausalLMWithValueHead.from_pretrained(
            causal_dir, summary_dropout_prob=0.5
        ).v_head.dropout.p
        == 0.5
    )
    base = AutoModelForCausalLM.from_pretrained(causal_dir)
    base.config.summary_dropout_prob = 0.3
    assert AutoModelForCausalLMWithValueHead.from_pretrained(base).v_head.dropout.p == 0.3
    normal = AutoModelForCausalLMWithValueHead.from_pretrained(
        causal_dir, v_head_init_strategy="normal", v_head_initializer_range=0.01
    )
    assert torch.count_nonzero(normal.v_head.summary.bias) == 0
    assert normal.v_head.summary.weight.std() < 0.05


def test_forward_returns_logits_loss_values(causal_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    logits, loss, values = model(ids, labels=ids)
    plain = AutoModelForCausalLM.from_pretrained(causal_dir).eval()(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, plain.logits)
    assert loss is not None and values.shape == (1, 5)
    torch.testing.assert_close(values, model.v_head(plain.hidden_states[-1]))


def test_save_load_round_trip_keeps_the_head(causal_dir, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir)
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "saved")
    _assert_same_state(model.state_dict(), again.state_dict())
    # transformers alone loads the policy from the same folder, with the same weights
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    policy_keys = {k for k in model.state_dict() if not k.startswith("v_head.")}
    assert policy_keys == set(plain.state_dict())
    for key in policy_keys:
        torch.testing.assert_close(plain.state_dict()[key], model.state_dict()[key], rtol=0, atol=0)


def test_sharded_save_round_trip(causal_dir, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    again = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "sharded")
    _assert_same_state(model.state_dict(), again.state_dict())


def test_peft_save_writes_adapter_and_head_only(causal_dir, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir, peft_config=_lora())
    assert model.is_peft_model and model.v_head.summary.weight.requires_grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n or n.startswith("v_head") for n in trainable)
    out = tmp_path / "peft"
    model.save_pretrained(out)
    assert os.path.isfile(out / "adapter_model.safetensors") and os.path.isfile(out / "adapter_config.json")
    head = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert set(head) == {"v_head.summary.weight", "v_head.summary.bias"}
    again = AutoModelForCausalLMWithValueHead.from_pretrained(out, is_trainable=True)
    assert again.is_peft_model
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0, msg=n1)
    assert {n for n, p in again.named_parameters() if p.requires_grad} == trainable


def test_bf16_and_generate(causal_dir):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir, dtype=torch.bfloat16)
    assert model.pretrained_model.lm_head.weight.dtype == torch.bfloat16
    assert model.v_head.summary.weight.dtype == torch.bfloat16
    model(torch.tensor([[0, 1, 0, 1]]))
    out = model.generate(torch.tensor([[5, 6, 7]]), generation_config=GenerationConfig(max_new_tokens=4))
    assert out.shape[1] > 3


def test_seq2seq_value_head(seq2seq_dir, tmp_path):
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(seq2seq_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    logits, loss, values = model(ids, decoder_input_ids=ids)
    assert logits.shape[:2] == (1, 4) and loss is None and values.shape == (1, 4)
    model.save_pretrained(tmp_path / "t5_saved")
    _assert_same_state(
        model.state_dict(),
        AutoModelForSeq2SeqLMWithValueHead.from_pretrained(tmp_path / "t5_saved").state_dict(),
    )
    model.generate(ids, decoder_input_ids=ids[:, :1], generation_config=GenerationConfig(max_new_tokens=3))


def test_damaged_head_file_is_named(causal_dir, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(causal_dir, peft_config=_lora())
    model.save_pretrained(tmp_path / "p")
    (tmp_path / "p" / "pytorch_model.bin").write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "p")


def test_batch_generation_matches_generate(causal_dir):
    model = AutoModelForCausalLM.from_pretrained(causal_dir).eval()
    queries = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [4, 5, 6, 7]])
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    query_responses, scores = batch_generation(model, queries, 2, 0, config)
    assert query_responses.shape == (3, 9) and scores.shape == (3, 5, model.config.vocab_size)
    whole, whole_scores = batch_generation(model, queries, 3, 0, config)
    torch.testing.assert_close(query_responses, whole)
    torch.testing.assert_close(scores, whole_scores, rtol=1e-5, atol=1e-5)
    direct = model.generate(input_ids=queries[2:], attention_mask=queries[2:] != 0, generation_config=config)
    torch.testing.assert_close(query_responses[2:], direct)
    assert torch.equal(scores[:, 0].argmax(-1), query_responses[:, 4])
    with pytest.raises(ValueError, match="local_rollout_forward_batch_size"):
        batch_generation(model, queries, 0, 0, config)


def test_masked_statistics():
    x, mask = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert masked_mean(x, mask) == torch.mean(x[1:3])
    assert masked_var(x, mask) == torch.var(x[1:3])
    inner = x[1:3]
    expected = (inner - inner.mean()) * torch.rsqrt(inner.var() + 1e-8)
    torch.testing.assert_close(masked_whiten(x, mask)[1:3], expected)
    rows, row_mask = torch.tensor([[1.0, 2.0], [3.0, 5.0]]), torch.tensor([[1, 0], [1, 1]])
    torch.testing.assert_close(masked_mean(rows, row_mask, axis=1), torch.tensor([1.0, 4.0]))  # TRL's keyword


def test_one_value_head_class_with_both_initialisations():
    """PPO's fused head ("scaled") draws N(0, 1/(H+1)) after nn.Linear's own init (the global RNG moves as
    it did for PPOTrainer and PPOSweep heads); "linear" is nn.Linear's init, as TRL's value-head models."""
    from torch import nn

    from rapidfire_hf.models.value_head import ValueHead

    torch.manual_seed(0)
    head = ValueHead(8)
    after_head = torch.randn(3)
    torch.manual_seed(0)
    ref = nn.Linear(8, 1)
    nn.init.normal_(ref.weight, std=1.0 / 3.0)
    assert torch.equal(head.summary.weight, ref.weight) and torch.count_nonzero(head.summary.bias) == 0
    assert torch.equal(after_head, torch.randn(3))  # the RNG moved exactly as before
    torch.manual_seed(0)
    linear = ValueHead(8, dropout=0.1, init="linear")
    torch.manual_seed(0)
    ref = nn.Linear(8, 1)
    assert torch.equal(linear.summary.weight, ref.weight) and torch.equal(linear.summary.bias, ref.bias)
    assert linear.dropout.p == 0.1
    hidden = torch.randn(2, 5, 8)
    assert torch.equal(head(hidden), (hidden @ head.summary.weight.T + head.summary.bias).squeeze(-1))
    with pytest.raises(ValueError, match="'scaled' or 'linear'"):
        ValueHead(8, init="xavier")
