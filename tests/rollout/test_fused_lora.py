"""``decode_fuse_lora``: LoRA layers in the fused decode projections (CPU, fp32).

Against the module path of the same engine (PEFT's own forward) and ``model.generate``: greedy tokens
equal, sampled log-probs within 1e-5 (stacked factors regroup the same products; the scaling is folded into
``B``). Adapter states the fused step does not reproduce run the module calls.
"""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy
from peft import LoraConfig, get_peft_model

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams
from rapidfire_hf.rollout.llama_forward import UNSUPPORTED, _lora_term, fused_projection_bytes

R = 40
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def _lora_model(tokenizer, dropout: float = 0.0, targets=TARGETS):
    base = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
    with torch.no_grad():  # B starts at zero: give the adapter a term the output shows
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return model.eval()


def _engine(model, fuse_lora: bool, fuse: bool = True):
    return RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static",
        decode_fuse_projections=fuse, decode_fuse_lora=fuse_lora,
    )  # fmt: skip


def _sampled(engine, ids, mask):
    params = SamplingParams(max_new_tokens=R, temperature=0.8)
    return engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(3))


def test_fused_lora_decode_equals_the_adapters_modules(tokenizer, prompts):
    model = _lora_model(tokenizer)
    ids, mask = prompts
    fused, plain = _engine(model, True), _engine(model, False, fuse=False)
    greedy = fused.generate(ids, mask, SamplingParams(max_new_tokens=R, do_sample=False))
    net = fused._static.net
    assert all(net.fused) and all(net.fused_now)  # every layer ran fused, with its adapter's factors
    assert all(pair is not None for pair in (*net._qkv_lora, *net._gu_lora))
    assert torch.equal(greedy.responses, hf_greedy(model, ids, mask, R, stop=None))
    a, b = _sampled(fused, ids, mask), _sampled(plain, ids, mask)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    # the adapter changes the output: a fused step that dropped it would differ from the modules
    with model.disable_adapter():
        base = _sampled(plain, ids, mask)
    assert not torch.allclose(base.logprobs, b.logprobs, atol=1e-3)


def test_adapter_updates_and_switches_are_followed(tokenizer, prompts):
    """A training step on the adapter, then generation with the adapter disabled, then merged: each time
    the fused step gives the modules' output, its factors refreshed in place."""
    model = _lora_model(tokenizer)
    ids, mask = prompts
    fused, plain = _engine(model, True), _engine(model, False, fuse=False)
    _sampled(fused, ids, mask)
    address = fused._static.net._qkv_lora[0][0].data_ptr()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name and "q_proj" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    a, b = _sampled(fused, ids, mask), _sampled(plain, ids, mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert fused._static.net._qkv_lora[0][0].data_ptr() == address
    with model.disable_adapter():
        a, b = _sampled(fused, ids, mask), _sampled(plain, ids, mask)
        assert all(fused._static.net.fused_now)
        assert all(pair is None for pair in fused._static.net._qkv_lora)  # no term while disabled
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    model.merge_adapter()
    try:
        a, b = _sampled(fused, ids, mask), _sampled(plain, ids, mask)
        assert all(pair is None for pair in fused._static.net._qkv_lora)  # the base weight holds it
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    finally:
        model.unmerge_adapter()


def test_states_it_cannot_reproduce_keep_the_modules(tokenizer, prompts):
    """Dropout that acts (training mode) and two active adapters: the layers run their module calls; the
    rollout is then the modules' own, draw for draw."""
    model = _lora_model(tokenizer, dropout=0.1).train()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert _lora_term(q) == UNSUPPORTED
    model.eval()
    assert _lora_term(q) != UNSUPPORTED  # the same dropout is inert in eval mode
    model.merge_adapter()
    with model.disable_adapter():  # PEFT unmerges on the next forward: the fused copy would be stale
        assert _lora_term(q) == UNSUPPORTED
    model.unmerge_adapter()
    model.add_adapter("second", LoraConfig(r=2, target_modules=TARGETS))
    model.base_model.set_adapter(["default", "second"])
    assert _lora_term(q) == UNSUPPORTED
    ids, mask = prompts
    fused, plain = _engine(model, True), _engine(model, False, fuse=False)
    a, b = _sampled(fused, ids, mask), _sampled(plain, ids, mask)
    assert not any(fused._static.net.fused_now)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)


def test_off_by_default_and_counted_by_the_planner(tokenizer):
    """Without ``decode_fuse_lora`` LoRA layers keep their modules (as before); the planner's copy bytes
    count them only with it; the PPOConfig switch is checked against the fused projections."""
    from rapidfire_hf.config import ConfigError
    from rapidfire_hf.ppo import PPOConfig

    model = _lora_model(tokenizer)
    assert not any(_engine(model, False)._static.net.fused)
    assert fused_projection_bytes(model) == 0 < fused_projection_bytes(model, lora=True)
    with pytest.raises(ValueError, match="set fuse_projections=True"):
        _engine(model, True, fuse=False)
    with pytest.raises(ConfigError, match="rollout_decode_fuse_lora=True"):
        PPOConfig(output_dir="x", rollout_decode_fuse_lora=True, rollout_decode_fuse_projections=False)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cuda_graph", "compile"])
def test_fused_lora_on_gpu_follows_the_adapter_between_recorded_steps(tokenizer, prompts, mode):
    """Recorded / compiled steps (fp32): greedy tokens equal the modules' with the adapter on, after an
    adapter update, and with the adapter disabled (the step recorded again for the changed state)."""
    model = _lora_model(tokenizer).cuda()
    ids, mask = (x.cuda() for x in prompts)
    params = SamplingParams(max_new_tokens=R, do_sample=False)
    engines = {
        fuse: RolloutEngine(
            model,
            pad_token_id=0,
            stop_token_ids=[],
            backend="static",
            decode_mode=mode,
            decode_fuse_projections=fuse,
            decode_fuse_lora=fuse,
        )  # fmt: skip
        for fuse in (True, False)
    }

    def both():
        return [engines[fuse].generate(ids, mask, params).responses for fuse in (True, False)]

    first = both()
    with torch.no_grad():  # a training step on the adapter between two rollouts
        for name, p in model.named_parameters():
            if "lora_B" in name and "v_proj" in name:
                p.mul_(-2.0)
    second = both()
    with model.disable_adapter():
        third = both()
    for fused, plain in (first, second, third):
        assert torch.equal(fused, plain)
    assert not torch.equal(first[1], third[1])  # the adapter shows in the tokens


def test_ppo_config_switch_reaches_the_engine_with_a_lora_policy(tokenizer, tmp_path):
    """PPOTrainer with a LoRA policy: rollout_decode_fuse_lora builds its engine with the LoRA layers fused,
    and the rollout is the one of the adapter's modules (same seed rule)."""
    from tests.ppo.helpers import tiny_trainer

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])

    def rollout_of(name, **kw):
        kw.setdefault("rollout_decode_fuse_projections", True)
        trainer = tiny_trainer(
            tmp_path / name, tokenizer, rollout_backend="static", trainer_kwargs={"peft_config": lora}, **kw
        )
        with torch.no_grad():  # the same non-zero adapter in both runs
            for pname, p in trainer.model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
        return trainer, trainer.rollout(trainer.next_prompts(0))

    plain_trainer, plain = rollout_of("plain")
    trainer, fused = rollout_of("fused", rollout_decode_fuse_lora=True)
    # with "auto" projections, which do not fuse on the CPU, the switch waits for them instead of refusing
    auto, _ = rollout_of("auto", rollout_decode_fuse_lora=True, rollout_decode_fuse_projections="auto")
    assert not any(auto.roller.engine._static.net.fused)
    assert all(trainer.roller.engine._static.net.fused_now)
    assert not any(plain_trainer.roller.engine._static.net.fused)
    assert torch.equal(fused.responses, plain.responses)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
