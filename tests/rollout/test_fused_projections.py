"""``decode_fuse_projections``: one matmul for q/k/v and one for gate/up in the decode step (CPU, fp32).

Against the module path of the same engine and against ``model.generate``: greedy tokens equal, sampled
log-probs within 1e-5 (a concatenated weight changes only how the GEMM blocks its output columns).
"""

from __future__ import annotations

import pytest
import torch
from _rollout_helpers import hf_greedy
from peft import LoraConfig, get_peft_model

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.rollout import RolloutEngine, SamplingParams

R = 40


def _engine(model, fuse: bool):
    return RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_fuse_projections=fuse
    )


def _sampled(engine, ids, mask):
    params = SamplingParams(max_new_tokens=R, temperature=0.8)
    return engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(3))


def test_fused_decode_equals_module_decode(tokenizer, prompts):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    fused = _engine(model, True)
    assert all(fused._static.net.fused)  # plain Llama linears: every layer fused
    greedy = fused.generate(ids, mask, SamplingParams(max_new_tokens=R, do_sample=False))
    assert torch.equal(greedy.responses, hf_greedy(model, ids, mask, R, stop=None))
    a, b = _sampled(fused, ids, mask), _sampled(_engine(model, False), ids, mask)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_fused_weights_follow_training_updates(tokenizer, prompts):
    """The concatenated weights are refreshed in place before each generation."""
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    fused, plain = _engine(model, True), _engine(model, False)
    before = _sampled(fused, ids, mask)
    address = fused._static.net.fused_weights()[0].data_ptr()
    with torch.no_grad():  # an optimizer step in place, as training does between rollouts
        for layer in model.model.layers:
            for lin in (layer.self_attn.k_proj, layer.mlp.up_proj):
                lin.weight.add_(torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(1)))
    after, reference = _sampled(fused, ids, mask), _sampled(plain, ids, mask)
    assert not torch.equal(before.logprobs, after.logprobs)
    assert torch.equal(after.responses, reference.responses)
    torch.testing.assert_close(after.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    assert fused._static.net.fused_weights()[0].data_ptr() == address  # refreshed in place


def test_peft_layers_keep_their_modules(tokenizer, prompts):
    """LoRA on q/v: those layers are not fused (the adapter would be bypassed); the output is the module's."""
    base = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    ids, mask = prompts
    fused = _engine(model, True)
    assert not any(fused._static.net.fused)
    a, b = _sampled(fused, ids, mask), _sampled(_engine(model, False), ids, mask)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("linear", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["cuda_graph", "compile"])
def test_fused_decode_on_gpu_matches_module_decode(tokenizer, prompts, mode, linear):
    """Recorded / compiled steps read the concatenated weights in place (fp32: greedy tokens equal), with
    the projections through F.linear or the Triton skinny matmul."""
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2).cuda()
    ids, mask = (x.cuda() for x in prompts)
    params = SamplingParams(max_new_tokens=R, do_sample=False)
    out = {}
    for fuse in (True, False):
        engine = RolloutEngine(
            model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode=mode,
            decode_fuse_projections=fuse, decode_linear=linear if fuse else "torch",
        )  # fmt: skip
        first = engine.generate(ids, mask, params)
        with torch.no_grad():  # a training step between two rollouts: the replayed graph must see it
            model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        out[fuse] = (first.responses, engine.generate(ids, mask, params).responses)
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.div_(1.5)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


def test_ppo_config_switch_reaches_the_engine(tokenizer, tmp_path):
    """PPOConfig(rollout_decode_fuse_projections=True) builds PPOTrainer's engine with fused layers; the
    rollout is the unfused one's (same seed rule)."""
    from rapidfire_hf.config import ConfigError
    from tests.ppo.helpers import tiny_trainer

    def rollout_of(**kw):
        trainer = tiny_trainer(tmp_path / str(len(kw)), tokenizer, rollout_backend="static", **kw)
        return trainer, trainer.rollout(trainer.next_prompts(0))

    plain_trainer, plain = rollout_of()
    trainer, fused = rollout_of(rollout_decode_fuse_projections=True)
    assert all(trainer.roller.engine._static.net.fused)
    assert not any(plain_trainer.roller.engine._static.net.fused)
    assert torch.equal(fused.responses, plain.responses)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="rollout_decode_fuse_projections"):
        tiny_trainer(tmp_path / "bad", tokenizer, rollout_decode_fuse_projections="yes please")


def test_decode_compile_mode_is_checked_and_kept(tokenizer):
    """``decode_compile_mode`` reaches the compiled step's ``torch.compile``; an unknown mode is refused."""
    model = build_tiny_llama(tokenizer)
    engine = RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static",
        decode_compile_mode="max-autotune-no-cudagraphs",
    )  # fmt: skip
    assert engine._static.compile_mode == "max-autotune-no-cudagraphs"
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_compile_mode="fast")


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_other_families_fuse_only_where_the_projections_allow(family):
    """Qwen3 (q/k norms after the projections) fuses and decodes the module path's tokens; Qwen2's biased
    q/k/v projections keep their modules."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, config = {"qwen3": (Qwen3ForCausalLM, Qwen3Config), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    torch.manual_seed(0)
    model = cls(
        config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        )
    ).eval()  # fmt: skip
    ids = torch.randint(3, 60, (3, 6), generator=torch.Generator().manual_seed(1))
    fused, plain = _engine(model, True), _engine(model, False)
    assert all(fused._static.net.fused) == (family == "qwen3") and not any(plain._static.net.fused)
    a, b = _sampled(fused, ids, torch.ones_like(ids)), _sampled(plain, ids, torch.ones_like(ids))
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _skinny_engine(model):
    return RolloutEngine(
        model,
        pad_token_id=0,
        stop_token_ids=[],
        backend="static",
        decode_fuse_projections=True,
        decode_linear="triton",
    )


def test_triton_linear_decode_equals_the_torch_decode(tokenizer, prompts):
    """``decode_linear="triton"`` (Triton's interpreter on the CPU, fp32): every fused layer's projections,
    o and down included, go through the skinny matmul; greedy tokens equal ``model.generate``'s, sampled
    tokens equal the F.linear path's and log-probs within 1e-5."""
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    ids, mask = prompts
    engine = _skinny_engine(model)
    net = engine._static.net
    assert all(net.fused) and all(out is not None for out in net._out_linear)
    calls = []
    original = net._linear
    assert original.__module__ == "rapidfire_hf.kernels.triton_skinny_matmul"
    net._linear = lambda x, w: calls.append(tuple(w.shape)) or original(x, w)
    net._out_linear = [net._linear] * len(net._out_linear)
    greedy = engine.generate(ids, mask, SamplingParams(max_new_tokens=R, do_sample=False))
    assert torch.equal(greedy.responses, hf_greedy(model, ids, mask, R, stop=None))
    layers = len(net.layers)
    assert len(calls) == 4 * layers * (R - 1)  # q/k/v, o, gate/up, down per layer per decode step
    a, b = _sampled(engine, ids, mask), _sampled(_engine(model, True), ids, mask)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_triton_linear_needs_fused_projections_and_keeps_lora_outputs(tokenizer):
    model = build_tiny_llama(tokenizer, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="fused decode projections only: set fuse_projections=True"):
        RolloutEngine(model, pad_token_id=0, backend="static", decode_linear="triton")
    with pytest.raises(ValueError, match=r"linear must be one of \('torch', 'triton'\), got 'cuda'"):
        RolloutEngine(
            model, pad_token_id=0, backend="static", decode_fuse_projections=True, decode_linear="cuda"
        )
    # LoRA on o_proj only: q/k/v and gate/up still fuse, but o and down keep their module calls
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"]))
    net = _skinny_engine(peft_model)._static.net
    assert all(net.fused) and not any(net._out_linear)


def test_ppo_config_linear_switch_reaches_the_engine(tokenizer, tmp_path):
    """PPOConfig(rollout_decode_linear="triton") builds PPOTrainer's engine on the skinny matmul (the
    interpreter here); the rollout is the F.linear one's. Without fused projections it is refused by the
    config, naming the switch."""
    from rapidfire_hf.config import ConfigError
    from tests.ppo.helpers import tiny_trainer

    def rollout_of(name, **kw):
        trainer = tiny_trainer(tmp_path / name, tokenizer, rollout_backend="static", **kw)
        return trainer, trainer.rollout(trainer.next_prompts(0))

    _, plain = rollout_of("plain", rollout_decode_fuse_projections=True)
    trainer, skinny = rollout_of(
        "skinny", rollout_decode_fuse_projections=True, rollout_decode_linear="triton"
    )
    net = trainer.roller.engine._static.net
    assert net._linear.__module__ == "rapidfire_hf.kernels.triton_skinny_matmul" and all(net._out_linear)
    assert torch.equal(skinny.responses, plain.responses)
    torch.testing.assert_close(skinny.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="also set rollout_decode_fuse_projections=True"):
        tiny_trainer(tmp_path / "alone", tokenizer, rollout_decode_linear="triton")
    with pytest.raises(ConfigError, match="rollout_decode_linear"):
        tiny_trainer(
            tmp_path / "bad", tokenizer, rollout_decode_fuse_projections=True, rollout_decode_linear="cuda"
        )
