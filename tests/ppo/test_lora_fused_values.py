"""With LoRA and the fused value head, the rollout's values come from the policy with its adapter on (as
training predicts them); only the reference log-probs use the adapter-disabled base."""

from __future__ import annotations

import torch
from peft import LoraConfig

from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.modeling import policy_logprobs
from tests.ppo.helpers import ppo_args


def test_scoring_values_use_the_adapter(tmp_path, tokenizer, single_thread):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = PPOTrainer(
        args=ppo_args(tmp_path, value_mode="fused", max_steps=1, learning_rate=1e-2),
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(16),
        peft_config=lora,
    )
    trainer.train()  # the adapter is no longer zero: adapter on and off now give different values
    exp = trainer.score(trainer.rollout(trainer.next_prompts(1)))
    qr, ctx = exp.rollout.query_responses, exp.rollout.queries.shape[1]
    module = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        _, values, _ = module(qr, trainer.pad_token_id, ctx, trainer.args.temperature)
        with module.policy.disable_adapter():
            _, base_values, _ = module(qr, trainer.pad_token_id, ctx, trainer.args.temperature)
            ref = policy_logprobs(module.policy, qr, trainer.pad_token_id, ctx, trainer.args.temperature)
    keep = ~exp.adv.padding_mask_p1
    assert not torch.allclose(values[keep], base_values[keep])  # the test can tell the two apart
    torch.testing.assert_close(exp.adv.values[keep], values[keep], rtol=1e-5, atol=1e-6)
    keep_lp = ~exp.adv.padding_mask
    torch.testing.assert_close(exp.adv.ref_logprobs[keep_lp], ref[keep_lp], rtol=1e-5, atol=1e-6)
