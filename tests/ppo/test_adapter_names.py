"""PPOConfig's TRL 1.12 adapter keys: ``ref_adapter_name`` makes another adapter of a multi-adapter PeftModel
the reference, ``model_adapter_name`` picks the adapter trained; bad names fail before training."""

from __future__ import annotations

import pytest
import torch
from helpers import ppo_args

from rapidfire_hf.ppo.core import INVALID_LOGPROB
from rapidfire_hf.ppo.modeling import policy_logprobs

peft = pytest.importorskip("peft")


def _two_adapter_policy(tok):
    """The tiny Llama with a trained-from-zero "default" adapter and a random "ref" adapter."""
    from rapidfire_hf.demo import build_tiny_llama

    torch.manual_seed(0)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build_tiny_llama(tok), peft.LoraConfig(**lora))
    model.add_adapter("ref", peft.LoraConfig(**lora, init_lora_weights=False))  # B != 0: not the base
    model.set_adapter("default")
    return model


def _trainer(tmp_path, tok, policy, **overrides):
    from rapidfire_hf.demo import make_prompt_dataset, vowel_reward
    from rapidfire_hf.ppo import PPOTrainer

    return PPOTrainer(
        args=ppo_args(tmp_path, value_mode="fused", **overrides),
        processing_class=tok,
        model=policy,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
    )


def _reference_logprobs(trainer, rollout, adapter):
    """Log-probs of the rollout's responses under the policy with ``adapter`` active (None: adapters off)."""
    policy, pad, ctx = trainer.policy, trainer.pad_token_id, rollout.queries.shape[1]
    with torch.no_grad():
        if adapter is None:
            with policy.disable_adapter():
                return policy_logprobs(policy, rollout.query_responses, pad, ctx, trainer.args.temperature)
        policy.set_adapter(adapter)
        try:
            return policy_logprobs(policy, rollout.query_responses, pad, ctx, trainer.args.temperature)
        finally:
            policy.set_adapter("default")


def test_ref_adapter_is_the_reference_and_the_training_adapter_comes_back(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, _two_adapter_policy(tokenizer), ref_adapter_name="ref")
    rollout = trainer.rollout(trainer.next_prompts(0))
    exp = trainer.score(rollout)
    kept = exp.adv.ref_logprobs != INVALID_LOGPROB
    want = _reference_logprobs(trainer, rollout, "ref")
    torch.testing.assert_close(exp.adv.ref_logprobs[kept], want[kept], rtol=0, atol=0)
    base = _reference_logprobs(trainer, rollout, None)
    assert (want[kept] - base[kept]).abs().max() > 1e-3  # the ref adapter is not the base
    assert trainer.policy.active_adapter == "default"
    trained = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trained and all(".default." in n for n in trained)


def test_without_ref_adapter_name_the_base_is_the_reference(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, _two_adapter_policy(tokenizer))
    rollout = trainer.rollout(trainer.next_prompts(0))
    exp = trainer.score(rollout)
    kept = exp.adv.ref_logprobs != INVALID_LOGPROB
    want = _reference_logprobs(trainer, rollout, None)
    torch.testing.assert_close(exp.adv.ref_logprobs[kept], want[kept], rtol=0, atol=0)


def test_model_adapter_name_picks_the_trained_adapter(tmp_path, tokenizer):
    policy = _two_adapter_policy(tokenizer)
    trainer = _trainer(tmp_path, tokenizer, policy, model_adapter_name="ref")
    assert trainer.policy.active_adapter == "ref"
    params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    names = {n for n, p in trainer.policy.named_parameters() if id(p) in params and "lora" in n}
    assert names and all(".ref." in n for n in names)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"ref_adapter_name": "nope"},
            r"ref_adapter_name='nope': the PeftModel has no such adapter \(it has \['default', 'ref'\]\)",
        ),
        ({"model_adapter_name": "nope"}, r"model_adapter_name='nope': the PeftModel has no such adapter"),
        ({"ref_adapter_name": "default"}, r"is the adapter being trained"),
    ],
)
def test_bad_adapter_names_fail_at_construction(tmp_path, tokenizer, overrides, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, tokenizer, _two_adapter_policy(tokenizer), **overrides)


def test_adapter_names_need_a_peft_model(tmp_path, tokenizer):
    from rapidfire_hf.demo import build_tiny_llama

    with pytest.raises(
        ValueError, match=r"ref_adapter_name name adapters of a PeftModel, but the model is not one"
    ):
        _trainer(tmp_path, tokenizer, build_tiny_llama(tokenizer), ref_adapter_name="ref")


def test_ds3_gather_for_generation_is_accepted_outside_zero3(tmp_path, tokenizer):
    from rapidfire_hf.demo import build_tiny_llama

    trainer = _trainer(tmp_path, tokenizer, build_tiny_llama(tokenizer), ds3_gather_for_generation=False)
    assert trainer.args.ds3_gather_for_generation is False
