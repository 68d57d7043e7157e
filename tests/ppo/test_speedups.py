"""PPOTrainer's opt-in speed-ups on CPU: per-layer torch.compile against the eager trainer, and the
errors of use_liger_kernel (whose kernels need a GPU: tests/ppo/test_speedups_gpu.py).

Tolerance: none. With the ``aot_eager`` (or ``eager``) backend the compiled layers run the same ATen
kernels as eager (AOTAutograd traces forward and backward into graphs without changing the arithmetic),
so one full PPO update (rollout, scoring, 2 epochs x 2 mini-batches with the optimizer stepping) gives
bit-identical policy and value parameters on CPU in fp32. (Inductor generates its own fused kernels and
is compared within bf16 tolerance on the GPU.)
"""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOTrainer
from rapidfire_hf.ppo.speedups import check_liger_usable, decoder_layers, liger_kwargs
from tests.ppo.helpers import ppo_args


def _train(tmp_path, tok, value_mode="separate", optimizer=None, peft_config=None, **kw):
    policy = build_tiny_llama(tok)
    value = build_tiny_value_model(tok) if value_mode == "separate" else None
    args = ppo_args(tmp_path, value_mode=value_mode, max_steps=1, max_grad_norm=0, **kw)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        value_model=value,
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
        optimizer=optimizer,
        peft_config=peft_config,
    )
    trainer.train()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return trainer, params


def _pipeline_optimizer():
    from rapidfire_hf.optim import RapidFireOptimizer

    return RapidFireOptimizer(lr=1e-3, gradient_pipeline=True)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)


@pytest.mark.parametrize(
    "case, backend",
    [
        ("separate_pipeline", "aot_eager"),
        ("fused_pipeline", "eager"),
        pytest.param("lora_separate", "eager", marks=pytest.mark.slow),  # ~6 s: PEFT layers trace slowly
    ],
)
def test_compiled_layers_train_bit_identically(tmp_path, tokenizer, case, backend):
    """One PPO update with every decoder layer compiled = the eager update, bit for bit: with the gradient
    pipeline's step-in-backward hooks (per-parameter post-accumulate-grad hooks fed by AOTAutograd's
    compiled backward), the fused value head and LoRA (whose reference is the adapter-disabled policy: a
    second graph of the same layers). aot_eager where the compiled backward meets the hooks; the plain
    "eager" backend (dynamo's graphs, run as traced) elsewhere, to keep the CPU time down."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (False, True):
        extra = {
            "separate_pipeline": {"optimizer": _pipeline_optimizer()},
            "fused_pipeline": {"value_mode": "fused", "optimizer": _pipeline_optimizer()},
            "lora_separate": {"peft_config": _lora()},
        }[case]
        if compiled:
            extra.update(torch_compile=True, torch_compile_backend=backend)
        trainer, params = _train(tmp_path / str(compiled), tokenizer, **extra)
        results.append(params)
        if compiled:
            expected = {"policy": 2, "value_model": 2, "ref_model": 2}
            if case != "separate_pipeline":  # fused: no value model; LoRA: the policy is the reference
                expected.pop("value_model" if case.startswith("fused") else "ref_model")
            assert trainer.kernel_patches.compiled == expected
            assert trainer.accelerator.unwrap_model(trainer.model).full_mask  # one mask kind: no recompiles
            assert counters["stats"]["unique_graphs"] > 0  # dynamo did capture the layers
            if "pipeline" in case:
                assert trainer.state.log_history[-1]["rapidfire/pipelined_steps"] > 0
        else:
            assert trainer.kernel_patches.compiled == {} and not counters["stats"]
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_compile_covers_every_distinct_model_once(tmp_path, tokenizer):
    """Policy, reference copy and value model each get their layers compiled; a model handed to a second
    trainer is not compiled again; the rollout runs the layers uncompiled."""
    args = ppo_args(tmp_path, torch_compile=True, torch_compile_backend="eager", max_steps=1)
    policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
    common = dict(processing_class=tokenizer, reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(8))
    trainer = PPOTrainer(args=args, model=policy, value_model=value, **common)
    assert trainer.kernel_patches.compiled == {"policy": 2, "value_model": 2, "ref_model": 2}
    assert trainer.accelerator.state.dynamo_plugin.backend.value == "NO"  # no second, whole-model compile
    layer = decoder_layers(trainer.policy, "policy")[0]
    compiled = layer._compiled_call_impl
    assert compiled is not None
    trainer.rollout(trainer.next_prompts(0))  # builds the rollout engine
    seen, generate = [], trainer.roller.engine.generate

    def spy(*a, **k):
        seen.append(layer._compiled_call_impl)
        return generate(*a, **k)

    trainer.roller.engine.generate = spy
    trainer.rollout(trainer.next_prompts(0))
    assert seen == [None] and layer._compiled_call_impl is compiled  # off while generating, back after
    again = PPOTrainer(args=args, model=policy, value_model=value, **common)
    assert again.kernel_patches.compiled == {"policy": 0, "value_model": 0, "ref_model": 2}


def test_compile_needs_decoder_layers(tmp_path, tokenizer):
    from rapidfire_hf.ppo.speedups import KernelPatches, compile_layers

    with pytest.raises(TypeError, match="no `layers` ModuleList"):
        compile_layers({"value_model": torch.nn.Linear(2, 2)}, "eager", None, KernelPatches())


def test_liger_needs_cuda(tmp_path, tokenizer):
    args = ppo_args(tmp_path, use_liger_kernel=True)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        PPOTrainer(
            args=args,
            processing_class=tokenizer,
            model=build_tiny_llama(tokenizer),
            value_model=build_tiny_value_model(tokenizer),
            reward_funcs=vowel_reward,
            train_dataset=make_prompt_dataset(8),
        )


def test_liger_not_installed_names_the_package(monkeypatch):
    import rapidfire_hf.ppo.speedups as speedups

    monkeypatch.setattr(speedups, "is_available", lambda name: name != "liger_kernel")
    with pytest.raises(ImportError, match=r"pip install 'rapidfire_hf\[liger\]'.*liger-kernel"):
        check_liger_usable(torch.device("cuda"))


def test_liger_keeps_per_token_logprobs():
    assert liger_kwargs({"rms_norm": False}) == {
        "rms_norm": False,
        "fused_linear_cross_entropy": False,
        "cross_entropy": False,
    }
    with pytest.raises(ValueError, match="per-token log-probs"):
        liger_kwargs({"fused_linear_cross_entropy": True})
    # compiled layers: RoPE from the compiler (Liger's runs under torch.compiler.disable), unless asked for
    assert liger_kwargs(None, compiled=True)["rope"] is False
    assert liger_kwargs({"rope": True}, compiled=True)["rope"] is True
    assert "rope" not in liger_kwargs(None)  # Liger's default (on)


@pytest.mark.parametrize("padded", [True, False])
def test_full_mask_is_the_mask_transformers_builds(tokenizer, padded):
    """The [B, 1, L, L] mask compiled layers always get gives the hidden states of transformers' own path,
    bit for bit: with padding (transformers then builds that mask) and without (it then drops the mask)."""
    from rapidfire_hf.ppo.modeling import sequence_inputs

    model = build_tiny_llama(tokenizer).eval()
    qr = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [0, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11, 12]])
    qr = qr if padded else qr[2:]
    plain, full = sequence_inputs(qr, 0), sequence_inputs(qr, 0, full_mask=True)
    assert full["attention_mask"].shape == (qr.shape[0], 1, 8, 8)
    with torch.no_grad():
        a = model.model(**plain, use_cache=False).last_hidden_state
        b = model.model(**full, use_cache=False).last_hidden_state
    real = plain["attention_mask"]
    assert torch.equal(a[real], b[real])  # pad positions are never read


def test_the_rollout_undoes_nothing_when_nothing_is_patched():
    """``KernelPatches.original()`` is a plain ``nullcontext`` without patched forwards or compiled layers (the
    rollout enters no context of the package then); with a patched forward, the module's own ``forward``
    runs inside and the patch is back after."""
    from contextlib import nullcontext

    from rapidfire_hf.ppo.speedups import KernelPatches

    assert isinstance(KernelPatches().original(), nullcontext)
    module = torch.nn.Linear(2, 2)

    def fast(x):
        return x

    module.__dict__["forward"] = fast
    patches = KernelPatches(_forwards=[(module, None, fast)])
    context = patches.original()
    assert not isinstance(context, nullcontext)
    with context:
        assert "forward" not in module.__dict__
    assert module.__dict__["forward"] is fast
