"""The run's identity and the settings check alone (``rapidfire_hf.checkpoint.identity``), on tiny models."""

from __future__ import annotations

import torch

from rapidfire_hf.checkpoint.identity import (
    adapter_identity,
    compare_identity,
    model_fingerprint,
    tokenizer_identity,
)
from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama
from rapidfire_hf.ppo.field_facts import compare_settings


def frozen(seed: int = 0, tok=None):
    return build_tiny_llama(tok or build_char_tokenizer(), seed=seed).requires_grad_(False)


def test_the_same_model_has_the_same_fingerprint_and_another_seed_not():
    a, b, c = model_fingerprint(frozen()), model_fingerprint(frozen()), model_fingerprint(frozen(seed=1))
    assert a == b and len(a) == len(list(frozen().parameters()))
    assert compare_identity({"frozen_models": {"base": a}}, {"frozen_models": {"base": c}}) == [
        "base: parameter model.embed_tokens.weight holds other values (same dtype and shape): another model "
        "of the same shape, another revision or another seed"
    ]


def test_one_changed_value_is_caught_where_it_is_sampled():
    model = frozen()
    before = model_fingerprint(model)
    with torch.no_grad():
        model.model.norm.weight[-1] += 1e-3  # the last value is always among the sampled ones
    after = model_fingerprint(model)
    assert [k for k in before if before[k] != after[k]] == ["model.norm.weight"]


def test_large_parameters_are_sampled_up_to_their_last_value():
    """Beyond 2**24 values a float position rounds past the end (found with a 32000 x 1024 embedding)."""
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(2**25 + 3, dtype=torch.int8), requires_grad=False)
    before = model_fingerprint(module)
    module.w.data[-1] = 1
    assert model_fingerprint(module) != before


def test_dtype_and_shape_are_named():
    a = model_fingerprint(frozen())
    b = model_fingerprint(frozen().to(torch.bfloat16))
    (problem,) = compare_identity({"frozen_models": {"base": a}}, {"frozen_models": {"base": b}})
    assert "is float32[46, 64] in the checkpoint's and bfloat16[46, 64] in this run's" in problem


def test_the_lora_wrapped_base_reads_as_the_plain_base():
    from peft import LoraConfig, get_peft_model

    plain = model_fingerprint(frozen())
    wrapped = get_peft_model(frozen(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert model_fingerprint(wrapped) == plain  # LoRA weights left out, PEFT's names unwrapped


def test_trainable_parameters_are_not_fingerprinted():
    assert model_fingerprint(frozen().requires_grad_(True)) is None and model_fingerprint(None) is None


def test_tokenizer_ids_matter_not_only_the_size():
    from tokenizers import decoders, pre_tokenizers

    from rapidfire_hf.demo.task import wordlevel_tokenizer

    vocab = dict(build_char_tokenizer().get_vocab())
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    swapped = wordlevel_tokenizer(
        vocab, pre_tokenizers.Split(pattern="", behavior="isolated"), decoders.Fuse()
    )
    a, b = tokenizer_identity(build_char_tokenizer()), tokenizer_identity(swapped)
    assert a == tokenizer_identity(build_char_tokenizer()) and a["size"] == b["size"] and a != b
    (problem,) = compare_identity({"tokenizer": a}, {"tokenizer": b})
    assert problem.startswith("tokenizer (processing_class): the same size but other token ids")


def test_every_changed_adapter_field_is_named():
    from peft import LoraConfig

    a = adapter_identity(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    b = adapter_identity(LoraConfig(r=4, lora_alpha=32, target_modules={"v_proj", "q_proj"}, use_rslora=True))
    problems = compare_identity({"adapters": {"policy": a}}, {"adapters": {"policy": b}})
    assert problems == [
        "LoRA adapter policy.lora_alpha: saved 8, this run 32 (peft_config)",
        "LoRA adapter policy.use_rslora: saved False, this run True (peft_config)",
    ]  # target_modules as a set or a list: the same


def test_settings_refused_and_kept():
    saved = {"response_length": 53, "learning_rate": 1e-5, "kl_coef": 0.05, "max_steps": 10}
    now = {"response_length": 64, "learning_rate": 2e-5, "kl_coef": 0.05, "max_steps": 20}
    refused, kept = compare_settings(saved, now)
    assert len(refused) == 1 and refused[0].startswith("response_length: saved 53, this run 64")
    assert kept == [
        "learning_rate: this run sets 2e-05, the checkpoint was saved with 1e-05; the checkpoint's 1e-05 is kept "
        "(the restored optimizer state carries it)"
    ]  # max_steps may change: a finished run extends
