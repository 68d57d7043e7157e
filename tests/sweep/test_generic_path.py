"""PPOSweep on a model only the rollout engine's generic path runs (OPT: no native forward of its family).

The sweep's batched decode runs the model's own forward over the engine's cache; the bank's routed LoRA layers
run inside that forward, so every row still goes through its own trial's adapter and a trial of the sweep is
the same run as the trial alone (bit-exact on CPU fp32, as with the native forward: test_independence.py).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from rapidfire_hf.rollout.engine import choose_decode_path

from .helpers import TRIALS, curves, make_sweep, max_abs_diff

TWO = {n: TRIALS[n] for n in list(TRIALS)[:2]}  # they differ in KL coefficient, learning rate and seed


def tiny_opt(tokenizer, seed: int = 0):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    # dropout off (OPT defaults to 0.1): dropout draws from the global RNG in training, which a sweep and a
    # trial alone consume differently
    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=128, dropout=0.0,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return OPTForCausalLM(config)


def test_opt_runs_on_the_generic_path_only(tokenizer):
    path, reason = choose_decode_path(tiny_opt(tokenizer))
    assert path == "generic" and "opt" in reason


@pytest.mark.usefixtures("single_thread")
def test_generic_sweep_decodes_in_one_batch_and_each_trial_equals_the_trial_alone(tokenizer, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    together = make_sweep(tokenizer, tmp_path / "all", TWO, model=tiny_opt(tokenizer), peft_config=lora)
    engine = together.phases.engine
    # one batched decode of every trial's rows, not one model.generate per trial
    assert (engine.backend, engine.path) == ("static", "generic")
    results = together.train()
    assert curves(results["kl0.01"]) != curves(results["kl0.2-lr3"])  # the trials differ
    for name, overrides in TWO.items():
        alone = make_sweep(
            tokenizer, tmp_path / name, {name: overrides}, model=tiny_opt(tokenizer), peft_config=lora
        )
        result = alone.train()[name]
        assert curves(results[name]) == curves(result), f"{name}: per-update metrics differ"
        assert max_abs_diff(together.adapter_state_dict(name), alone.adapter_state_dict(name)) == 0.0
        assert results[name].global_step == result.global_step == 3


def test_static_backend_is_taken_for_a_generic_model(tokenizer, tmp_path, recwarn):
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    sweep = make_sweep(tokenizer, tmp_path, {"a": {}}, model=tiny_opt(tokenizer), peft_config=lora,
                       rollout_backend="static", max_steps=1)  # fmt: skip
    assert sweep.phases.engine.path == "generic"
    # the sweep's SDPA default for the native attention is not passed to (and warned about by) the generic path
    assert not [w for w in recwarn if "native decode path only" in str(w.message)]


def test_conv1d_targets_are_refused_naming_the_workaround(tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"])
    with pytest.raises(ValueError, match=r"Conv1D .*nn.Linear only.*PPOTrainer\(peft_config=...\)"):
        make_sweep(tokenizer, tmp_path, {"a": {}}, model=gpt2, peft_config=lora)
