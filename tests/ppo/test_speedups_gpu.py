"""PPOTrainer's speed-ups on CUDA (skipped on CPU): Liger kernels and compiled decoder layers against the
stock model, then one PPO update with each.

Tolerance ("within bf16"): on a fixed padded batch, the policy's per-token log-probs and the value model's
values of the patched bf16 models may be at most twice as far from an fp32 copy of the same weights as the
stock bf16 models are, plus 1e-2 absolute (a few bf16 roundings of an O(1) number: bf16 keeps 8
significant bits, a relative step of 2^-8 = 0.4%). Liger and inductor round differently from eager bf16
(Liger's RMSNorm and inductor's fused kernels keep fp32 intermediates), so bit equality is not expected;
a wrong kernel (a RoPE on the wrong positions, a mask dropped) is off by O(0.1..1).

1-3 minutes on an H200, most of it inductor compiling the tiny layers (forward, backward, no-grad).
"""

from __future__ import annotations

import copy

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.modeling import policy_logprobs, sequence_inputs, value_positions
from tests.ppo.helpers import ppo_args

pytestmark = pytest.mark.gpu

VARIANTS = {
    "liger": {"use_liger_kernel": True},
    "compile": {"torch_compile": True},
    "liger+compile": {"use_liger_kernel": True, "torch_compile": True},
}
CTX = 6  # prompt columns of the fixed batch


@pytest.fixture()
def restore_liger_globals(monkeypatch):
    """Liger also patches transformers' Llama module (RoPE function, RMSNorm and MLP classes) for the whole
    process: put them back after each test so that later tests build stock models."""
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))


def _batch(vocab: int, pad: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    qr = torch.randint(4, vocab, (4, CTX + 10), generator=g)
    qr[0, :3] = pad  # left padding of two prompts; the other two unpadded
    qr[1, :1] = pad
    return qr.cuda()


@torch.no_grad()
def _outputs(policy, value, qr, pad, full_mask=False):
    lp = policy_logprobs(policy, qr, pad, CTX, 1.0, full_mask).float()
    v = value_positions(value, sequence_inputs(qr, pad, full_mask), CTX).float()
    return lp, v


def _assert_within_bf16(name, got, stock, fp32):
    err, floor = (got - fp32).abs().max().item(), (stock - fp32).abs().max().item()
    assert err <= 2 * floor + 1e-2, f"{name}: {err:.3g} from fp32, stock bf16 {floor:.3g}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speedup_matches_stock_model_and_trains(tmp_path, tokenizer, restore_liger_globals, variant):
    if "liger" in variant:
        pytest.importorskip("liger_kernel")
    torch._dynamo.reset()
    pad = tokenizer.pad_token_id
    policy = build_tiny_llama(tokenizer, dtype=torch.bfloat16).cuda()
    value = build_tiny_value_model(tokenizer).to(torch.bfloat16).cuda()
    qr = _batch(policy.config.vocab_size, pad)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # (torch_compile=True turns TF32 on in TrainingArguments)
    try:
        fp32 = _outputs(copy.deepcopy(policy).float(), copy.deepcopy(value).float(), qr, pad)
        stock = _outputs(policy, value, qr, pad)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    args = ppo_args(
        tmp_path, use_cpu=False, bf16=True, max_steps=1, rollout_decode_mode="eager", **VARIANTS[variant]
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        value_model=value,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
    )
    patches = trainer.kernel_patches
    if "liger" in variant:
        assert set(patches.liger) == {"policy", "value_model", "ref_model"}
        assert all(p["liger_modules"] > 0 and not p["already_patched"] for p in patches.liger.values())
    if "compile" in variant:
        assert patches.compiled == {"policy": 2, "value_model": 2, "ref_model": 2}
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)

    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = _outputs(trainer.policy, unwrapped.value_model, qr, pad, unwrapped.full_mask)
        train_lp, train_v, _ = unwrapped(qr, pad, CTX, 1.0)  # the training forward, with grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for name, g, s, f in zip(("logprobs", "values"), got, stock, fp32):
        _assert_within_bf16(name, g, s, f)
    _assert_within_bf16("training logprobs", train_lp.detach().float(), stock[0], fp32[0])
    _assert_within_bf16("training values", train_v.detach().float(), stock[1], fp32[1])

    trainer.train()
    log = trainer.state.log_history[-1]
    for key in ("loss/policy_avg", "loss/value_avg", "objective/kl"):
        assert torch.isfinite(torch.tensor(log[key])), (key, log[key])


def test_liger_refuses_a_model_type_it_has_no_kernels_for(restore_liger_globals):
    pytest.importorskip("liger_kernel")
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidfire_hf.ppo.speedups import KernelPatches, apply_liger

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="no kernels for the policy .*gpt2"):
        apply_liger({"policy": gpt2}, None, KernelPatches())


def test_liger_is_not_applied_twice(tokenizer, restore_liger_globals):
    pytest.importorskip("liger_kernel")
    from rapidfire_hf.ppo.speedups import KernelPatches, apply_liger

    policy = build_tiny_llama(tokenizer).cuda()
    first, second = KernelPatches(), KernelPatches()
    apply_liger({"policy": policy, "ref_model": policy}, None, first)  # the same model under two roles
    assert list(first.liger) == ["policy"] and not first.liger["policy"]["already_patched"]
    apply_liger({"policy": policy}, None, second)
    assert second.liger["policy"]["already_patched"] and not second._forwards
