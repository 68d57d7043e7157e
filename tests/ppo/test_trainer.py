"""PPOTrainer end to end on CPU with tiny models: training, callbacks, errors, resume, LoRA, fused value."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from rapidfire_hf.demo import (
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_value_model,
    make_prompt_dataset,
    vowel_reward,
)
from rapidfire_hf.ppo import PPOTrainer
from tests.ppo.helpers import ppo_args

_args = ppo_args


def _trainer(tmp_path, tok, policy=None, value=None, **kw):
    extra = {
        k: kw.pop(k)
        for k in list(kw)
        if k
        in (
            "optimizer",
            "optimizers",
            "peft_config",
            "callbacks",
            "reward_model",
            "reward_funcs",
            "train_dataset",
            "ref_model",
        )
    }
    extra.setdefault("reward_funcs", None if "reward_model" in extra else vowel_reward)
    extra.setdefault("train_dataset", make_prompt_dataset(32))
    args = _args(tmp_path, **kw)
    if value is None and args.value_mode == "separate":
        value = build_tiny_value_model(tok)
    return PPOTrainer(
        args=args, processing_class=tok, model=policy or build_tiny_llama(tok), value_model=value, **extra
    )


class EventRecorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")
            return lambda *a, **k: events.append(name)
        return object.__getattribute__(self, name)


def test_trains_and_fires_callbacks(tmp_path, tokenizer):
    rec = EventRecorder()
    trainer = _trainer(tmp_path, tokenizer, callbacks=[rec], save_strategy="steps", save_steps=2)
    policy_before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert len(logs) == 2
    for key in (
        "objective/kl",
        "objective/entropy",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/value_avg",
        "val/clipfrac_avg",
        "tokens_per_second",
        "objective/rlhf_reward",
    ):
        assert key in logs[-1] and logs[-1][key] == logs[-1][key]  # present and not NaN
    changed = any(not torch.equal(policy_before[k], v) for k, v in trainer.policy.state_dict().items())
    assert changed
    ev = rec.events
    assert ev[0] == "on_init_end" and "on_train_begin" in ev and ev[-1] == "on_train_end"
    # 2 updates x 2 epochs x 2 mini-batches = 8 optimizer steps
    assert ev.count("on_optimizer_step") == 8 and ev.count("on_pre_optimizer_step") == 8
    assert ev.count("on_step_begin") == 2 and ev.count("on_step_end") == 2 and ev.count("on_log") == 2
    assert ev.count("on_save") == 1 and (tmp_path / "checkpoint-2" / "policy" / "config.json").is_file()


def test_reward_model_and_fused_value(tmp_path, tokenizer):
    rm = build_tiny_value_model(tokenizer, seed=7)
    trainer = _trainer(tmp_path, tokenizer, reward_model=rm, value_mode="fused", max_steps=1)
    assert trainer.accelerator.unwrap_model(trainer.model).fused
    trainer.train()
    assert "objective/scores" in trainer.state.log_history[-1]


class StopAt(TrainerCallback):
    """Interrupts training after ``step`` updates (a run cut short, to be resumed)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _run(tmp_path, tokenizer, resume=None, **kw):
    trainer = _trainer(tmp_path, tokenizer, max_steps=4, save_strategy="steps", save_steps=2, **kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_resume_is_bit_identical(tmp_path, tokenizer):
    straight = _run(tmp_path / "a", tokenizer)
    interrupted = _run(tmp_path / "b", tokenizer, callbacks=[StopAt(2)])
    assert interrupted.state.global_step == 2
    resumed = _run(tmp_path / "b", tokenizer, resume=str(tmp_path / "b" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    va = straight.accelerator.unwrap_model(straight.model).value_model.state_dict()
    vb = resumed.accelerator.unwrap_model(resumed.model).value_model.state_dict()
    assert all(torch.equal(va[k], vb[k]) for k in va)
    last_a = [h for h in straight.state.log_history if "objective/kl" in h][-1]
    last_b = [h for h in resumed.state.log_history if "objective/kl" in h][-1]
    assert last_a["objective/kl"] == last_b["objective/kl"]


def test_max_grad_norm_is_honoured(tmp_path, tokenizer):
    """With SGD (no normalisation) a tiny max_grad_norm bounds the total parameter change."""
    policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
    params = [p for m in (policy, value) for p in m.parameters()]
    before = torch.cat([p.detach().flatten().clone() for p in params])
    opt = torch.optim.SGD(params, lr=0.5)
    trainer = _trainer(
        tmp_path,
        tokenizer,
        policy,
        value,
        optimizers=(opt, None),
        max_steps=1,
        max_grad_norm=1e-4,
        lr_scheduler_type="constant",
    )
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in params])
    steps = 4  # 2 epochs x 2 mini-batches
    assert 0 < (after - before).norm() <= steps * 0.5 * 1e-4 * 1.001


def test_max_grad_norm_zero_leaves_gradients_unclipped(tmp_path, tokenizer):
    """max_grad_norm=0 is TRL 1.12's PPO (which never clips): the optimizer sees backward's gradient, and one
    SGD step moves the parameters by exactly -lr * that gradient; max_grad_norm > 0 scales it to the norm."""
    norms = {}
    for clip in (0.0, 1e-4):
        torch.manual_seed(0)
        policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
        params = [p for m in (policy, value) for p in m.parameters()]
        before = [p.detach().clone() for p in params]
        opt = torch.optim.SGD(params, lr=0.5)
        seen = []
        opt.register_step_pre_hook(
            lambda o, a, k, seen=seen, params=params: seen.append(
                [p.grad.clone() if p.grad is not None else None for p in params]
            )
        )
        trainer = _trainer(
            tmp_path / str(clip),
            tokenizer,
            policy,
            value,
            optimizers=(opt, None),
            max_steps=1,
            num_ppo_epochs=1,
            num_mini_batches=1,
            max_grad_norm=clip,
            lr_scheduler_type="constant",
        )
        trainer.train()
        assert len(seen) == 1  # one epoch, one mini-batch: one optimizer step
        grads = seen[0]
        norms[clip] = torch.stack([g.norm() for g in grads if g is not None]).norm().item()
        for p, b, g in zip(params, before, grads):
            expected = b if g is None else b - 0.5 * g
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)
    assert norms[0.0] > 10 * 1e-4  # unclipped: far above the clip norm of the second run
    assert norms[1e-4] == pytest.approx(1e-4, rel=1e-3)  # clipped to max_grad_norm


def test_lora_reference_is_the_adapter_disabled_base(tmp_path, tokenizer):
    from peft import LoraConfig

    base = build_tiny_llama(tokenizer)
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    trainer = _trainer(
        tmp_path,
        tokenizer,
        base,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        max_steps=1,
    )
    assert trainer.ref_model is None and trainer.is_peft
    trainer.train()
    policy = trainer.policy
    for name, p in policy.named_parameters():
        if "lora_" not in name:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p.detach(), frozen[key]), name
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = build_tiny_llama(tokenizer)
    plain.load_state_dict(frozen)
    from rapidfire_hf.ppo.modeling import policy_logprobs

    with trainer.scorer.reference() as ref:
        ref_lp = policy_logprobs(ref, ids, tokenizer.pad_token_id, 3, 1.0)
    lora_lp = policy_logprobs(policy, ids, tokenizer.pad_token_id, 3, 1.0)
    base_lp = policy_logprobs(plain, ids, tokenizer.pad_token_id, 3, 1.0)
    torch.testing.assert_close(ref_lp, base_lp, rtol=0, atol=1e-6)
    assert (lora_lp - base_lp).abs().max() > 1e-6  # init_lora_weights=False: the adapter changes outputs


def test_a_separate_reference_is_yielded_by_a_plain_nullcontext(tmp_path, tokenizer):
    """Scoring switches no adapter with a separate reference model: ``Scorer.reference()`` is a plain
    ``nullcontext`` yielding it (no context of the package entered per scoring chunk)."""
    from contextlib import nullcontext

    trainer = _trainer(tmp_path, tokenizer, max_steps=1)
    assert trainer.ref_model is not None
    context = trainer.scorer.reference()
    assert isinstance(context, nullcontext)
    with context as ref:
        assert ref is trainer.ref_model


def test_rapidfire_optimizer_pipeline_matches_plain_step(tmp_path, tokenizer):
    from rapidfire_hf.optim import RapidFireOptimizer

    results = []
    for pipeline in (False, True):
        policy, value = build_tiny_llama(tokenizer), build_tiny_value_model(tokenizer)
        opt = RapidFireOptimizer(lr=1e-3, gradient_pipeline=pipeline)
        trainer = _trainer(tmp_path / str(pipeline), tokenizer, policy, value, optimizer=opt, max_grad_norm=0)
        assert opt.is_bound
        trainer.train()
        results.append([p.detach().clone() for p in policy.parameters()])
        if pipeline:
            assert trainer.state.log_history[-1]["rapidfire/pipelined_steps"] > 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- bad input, raised before any step
def test_dataset_without_prompt_column(tmp_path, tokenizer):
    from datasets import Dataset

    with pytest.raises(ValueError, match="no prompt column.*'text'"):
        _trainer(tmp_path, tokenizer, train_dataset=Dataset.from_dict({"text": ["a", "b"]}))


def test_tokenizer_without_pad_token(tmp_path):
    tok = build_char_tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        _trainer(
            tmp_path,
            tok,
            policy=build_tiny_llama(build_char_tokenizer()),
            value=build_tiny_value_model(build_char_tokenizer()),
        )


def test_value_model_of_wrong_shape(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="num_labels=1"):
        _trainer(tmp_path, tokenizer, value=build_tiny_value_model(tokenizer, num_labels=2))
    with pytest.raises(TypeError, match="sequence-classification"):
        _trainer(tmp_path, tokenizer, value=build_tiny_llama(tokenizer, seed=5))


def test_reward_model_and_reward_funcs_exclusive(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="exactly one of reward_model"):
        _trainer(
            tmp_path, tokenizer, reward_model=build_tiny_value_model(tokenizer), reward_funcs=vowel_reward
        )
    with pytest.raises(ValueError, match="exactly one of reward_model"):
        _trainer(tmp_path, tokenizer, reward_funcs=[])


def test_optimizer_and_optimizers_exclusive(tmp_path, tokenizer):
    policy = build_tiny_llama(tokenizer)
    opt = torch.optim.AdamW(policy.parameters())
    with pytest.raises(ValueError, match="either optimizer= or optimizers="):
        _trainer(tmp_path, tokenizer, policy, optimizer=opt, optimizers=(opt, None))


def test_unknown_rapidfire_config_key(tmp_path, tokenizer):
    from rapidfire_hf.config import ConfigError

    with pytest.raises(ConfigError, match="pipline_depth"):
        _trainer(tmp_path, tokenizer, rapidfire_config={"gradient": {"pipline_depth": 4}})


def test_bad_ppo_config_values(tmp_path):
    with pytest.raises(ValueError, match="kl_estimator='k2'"):
        _args(tmp_path, kl_estimator="k2")
    with pytest.raises(ValueError, match="not divisible by num_mini_batches=3"):
        _args(tmp_path, num_mini_batches=3)
    with pytest.raises(ValueError, match="rollout_decode_mode='graph'.*'cuda_graph'"):
        _args(tmp_path, rollout_decode_mode="graph")


def test_sample_tables_use_the_eval_prompts(tmp_path, tokenizer, capsys):
    from datasets import Dataset

    evals = Dataset.from_dict({"prompt": ["task: zzzz ->", "task: qq ->"]})
    trainer = _trainer(tmp_path, tokenizer, num_sample_generations=2, max_steps=2)
    trainer_eval = PPOTrainer(
        args=trainer.args,
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        value_model=build_tiny_value_model(tokenizer),
        reward_funcs=vowel_reward,
        train_dataset=make_prompt_dataset(32),
        eval_dataset=evals,
    )
    trainer_eval.train()
    out = capsys.readouterr().out
    assert out.count("completions at step") == 2 and "zzzz" in out and "qq" in out


def test_adaptive_precision_runs_the_sensitivity_pass(tmp_path, tokenizer):
    """precision.mode adaptive: the first scored rollouts feed the plugin's sensitivity pass (fp32 weights),
    every layer gets a finite error, and the pass writes no gradients (the optimizer steps as without it)."""
    cfg = {"precision": {"mode": "adaptive"}, "gradient": {"pipeline": True}}
    # the plugin's base precision is the trainer's autocast (bf16 here; an fp32 base has nothing to measure)
    trainer = _trainer(tmp_path, tokenizer, rapidfire_config=cfg, max_steps=2, bf16=True, use_cpu=True)
    plugin = trainer.precision_plugin
    assert plugin.initial.value == "bf16"
    assert plugin is not None and not plugin.calibration_done
    before = [p.detach().clone() for p in trainer.model.parameters()]
    exp = trainer.score(trainer.rollout(trainer.next_prompts(0)))
    trainer._calibrate_precision(exp)
    assert plugin.calibration_done
    rows = list(plugin.sensitivity.values())
    assert len(rows) == len(plugin.layers) > 0
    assert all(torch.isfinite(torch.tensor([r.output_error, r.grad_error])).all() for r in rows)
    # the pass wrote no gradient and moved no parameter (the pipeline's hooks never fired)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    trainer.train()  # and training goes on with the schedule
    assert trainer.state.global_step == 2


def test_the_rollouts_sampling_settings_are_built_once(tmp_path, tokenizer, monkeypatch):
    """The Roller builds (and validates) the sampling settings of a rollout and of a greedy one when it is
    made; rollouts reuse them."""
    from rapidfire_hf.ppo.rollout_phase import sampling_params
    from rapidfire_hf.rollout.types import SamplingParams

    trainer = _trainer(tmp_path, tokenizer, max_steps=1)
    assert trainer.roller.sampling == {
        True: sampling_params(trainer.args),
        False: sampling_params(trainer.args, False),
    }
    built, check = [], SamplingParams.__post_init__
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: built.append(self) or check(self))
    batch = trainer.next_prompts(0)
    trainer.rollout(batch)
    trainer.rollout(batch, sampling=False)
    assert built == []


def test_the_precision_plugin_is_the_one_registered_gradient_observer(tmp_path, tokenizer):
    """The stepper calls the precision plugin's ``observe_gradients`` itself, once per window with the
    window's gradients present; the trainer registers it when the plugin is set (again when replaced), and
    nothing without a plugin."""
    plain = _trainer(tmp_path / "plain", tokenizer, max_steps=1)
    assert plain.precision_plugin is None and plain.stepper.events.gradients_ready is None
    trainer = _trainer(tmp_path, tokenizer, rapidfire_config={"precision": {"mode": "adaptive"}}, max_steps=1)
    plugin = trainer.precision_plugin
    assert trainer.stepper.events.gradients_ready == plugin.observe_gradients
    seen, observe = [], plugin.observe_gradients
    plugin.observe_gradients = lambda: (
        seen.append(any(p.grad is not None for p in trainer.model.parameters())) or observe()
    )
    trainer.precision_plugin = plugin  # registered again: the patched method
    trainer.train()
    args = trainer.args
    assert seen == [True] * (args.num_ppo_epochs * args.num_mini_batches)
    trainer.precision_plugin = None
    assert trainer.stepper.events.gradients_ready is None
    with pytest.raises(TypeError, match="AdaptivePrecisionPlugin .* or None, got str"):
        trainer.precision_plugin = "adaptive"
    assert trainer.precision_plugin is None and trainer.stepper.events.gradients_ready is None


def test_the_precision_probe_is_unhooked_while_generating_and_hooked_while_training(tmp_path, tokenizer):
    """The adaptive plugin's output probe records only under gradients: its layer hooks are off during the
    rollout's generation (issue 44: no call per decode step) and on in the PPO epochs and after."""
    trainer = _trainer(tmp_path, tokenizer, rapidfire_config={"precision": {"mode": "adaptive"}}, max_steps=2)
    layers = list(trainer.precision_plugin.layers.values())
    assert layers and all(len(m._forward_hooks) == 1 for m in layers)
    seen = {}

    def hooks():
        return sum(len(m._forward_hooks) for m in layers)

    rollout, optimize = trainer.roller.rollout, trainer.epochs.optimize
    trainer.roller.rollout = lambda *a, **k: (
        seen.setdefault("rollout", []).append(hooks()) or rollout(*a, **k)
    )
    trainer.epochs.optimize = lambda *a, **k: (
        seen.setdefault("train", []).append(hooks()) or optimize(*a, **k)
    )
    trainer.train()
    assert seen == {"rollout": [0, 0], "train": [len(layers)] * 2}
    assert hooks() == len(layers)


def test_adaptive_precision_without_fp32_weights_skips_the_pass(tmp_path, tokenizer, caplog):
    cfg = {"precision": {"mode": "adaptive"}}
    policy = build_tiny_llama(tokenizer).to(torch.bfloat16)
    value = build_tiny_value_model(tokenizer).to(torch.bfloat16)
    trainer = _trainer(tmp_path, tokenizer, policy=policy, value=value, rapidfire_config=cfg, max_steps=1)
    with caplog.at_level("INFO", logger="rapidfire_hf.ppo.trainer"):
        trainer.train()
    assert not trainer.precision_plugin.calibration_done
    assert "no precision sensitivity pass" in caplog.text


def test_clip_prediction_scale_pipelines_binding_windows(tmp_path, tokenizer):
    """gradient.clip_prediction 'scale' with a clip that always binds: windows are stepped in the pipeline
    with a predicted coefficient (misses are rolled back and replayed), training stays finite."""
    cfg = {"gradient": {"pipeline": True, "clip_prediction": "scale", "clip_tolerance": 0.5}}
    trainer = _trainer(tmp_path, tokenizer, rapidfire_config=cfg, max_grad_norm=1e-3, max_steps=3)
    opt = trainer.rapidfire_optimizer
    assert opt.clip_prediction == "scale" and opt.clip_tolerance == 0.5
    assert opt.pipeline_share == trainer.rf_config.gradient.overlap_factor  # the config reaches it
    assert opt.pipeline_depth == trainer.rf_config.gradient.pipeline_depth
    predicted = []  # the last verified window's predicted coefficient, after each step (None: not pipelined)

    class Predictions(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            predicted.append(opt.stats()["clip_coef_predicted"])

    trainer.add_callback(Predictions())
    trainer.train()
    stats = opt.stats()
    assert stats["pipelined_steps"] > 0 and stats["clip_checks"] == stats["pipelined_steps"]
    # (after a clip miss the next windows are stepped after backward, so the last one may have none)
    assert any(c is not None and c < 1.0 for c in predicted)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("value_mode", ["separate", "fused"])
def test_rollout_and_scoring_gather_only_what_they_run(tmp_path, tokenizer, monkeypatch, value_mode):
    """Under ZeRO-3 / FSDP2 a gather holds whole weights on every GPU: generation runs the policy alone,
    scoring with a separate reference model the value model alone (the fused head needs the policy)."""
    from contextlib import contextmanager

    from rapidfire_hf.ppo import rollout_phase, scoring

    seen = []

    @contextmanager
    def recording_gather(accelerator, model, submodule=None):
        seen.append(submodule)
        yield accelerator.unwrap_model(model)

    monkeypatch.setattr(rollout_phase, "gathered_for_generation", recording_gather)
    monkeypatch.setattr(scoring, "gathered_for_generation", recording_gather)
    trainer = _trainer(tmp_path, tokenizer, value_mode=value_mode, max_steps=1)
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.ref_model is not None and len(seen) >= 2
    assert seen[0] is unwrapped.policy  # rollout
    assert seen[1] is (unwrapped.value_model if value_mode == "separate" else None)  # scoring


def _inner_torch_optimizer(trainer):
    opt = trainer.optimizer
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it


def test_default_optimizer_kernel_cpu(tmp_path, tokenizer):
    """On CPU the default AdamW keeps torch's default kernel (fused is a CUDA-only default here)."""
    inner = _inner_torch_optimizer(_trainer(tmp_path, tokenizer))
    assert isinstance(inner, torch.optim.AdamW) and not inner.defaults.get("fused")


@pytest.mark.gpu
def test_default_optimizer_is_fused_on_one_gpu(tmp_path, tokenizer):
    """On one GPU the default AdamW is the fused kernel: no foreach temporaries of the optimizer state."""
    inner = _inner_torch_optimizer(_trainer(tmp_path, tokenizer, use_cpu=False, max_steps=1))
    assert inner.defaults["fused"] is True
    assert all(p.is_cuda for g in inner.param_groups for p in g["params"])


def test_fused_value_head_dtype(tmp_path, tokenizer):
    """fp32 head under mixed precision; without it, the policy's one dtype (pure bf16: FSDP2's root unit
    needs one dtype, and one GPU then trains the same numerics)."""
    from rapidfire_hf.ppo.modeling import value_head_dtype

    policy = build_tiny_llama(tokenizer).to(torch.bfloat16)
    assert value_head_dtype(policy, mixed_precision="no") == torch.bfloat16
    assert value_head_dtype(policy, mixed_precision="bf16") == torch.float32
    mixed = build_tiny_llama(tokenizer)
    mixed.lm_head.to(torch.bfloat16)
    assert value_head_dtype(mixed, mixed_precision="no") == torch.float32
    trainer = _trainer(tmp_path, tokenizer, policy=policy, value_mode="fused", max_steps=1)
    head = trainer.accelerator.unwrap_model(trainer.model).value_head
    assert trainer.accelerator.mixed_precision == "no" and head.summary.weight.dtype == torch.bfloat16
    fp32 = _trainer(tmp_path, tokenizer, value_mode="fused", max_steps=1)
    assert fp32.accelerator.unwrap_model(fp32.model).value_head.summary.weight.dtype == torch.float32


def test_rollout_generation_batch_size_generates_in_chunks(tmp_path, tokenizer):
    import copy

    policy = build_tiny_llama(tokenizer)
    value = build_tiny_value_model(tokenizer)
    # top_k=1: every draw is the argmax, so chunked and whole-batch rollouts must give the same tokens
    whole = _trainer(tmp_path / "a", tokenizer, copy.deepcopy(policy), copy.deepcopy(value), top_k=1)
    chunked = _trainer(
        tmp_path / "b",
        tokenizer,
        copy.deepcopy(policy),
        copy.deepcopy(value),
        top_k=1,
        rollout_generation_batch_size=3,
    )
    batch = whole.next_prompts(0)
    assert batch["input_ids"].shape[0] == 8  # 4 x 2 accumulation steps

    def rows_seen(trainer):
        seen = []

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                seen.append(ids.shape[0])

        handle = trainer.policy.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            out = trainer.rollout(batch)
        finally:
            handle.remove()
        return out, set(seen)

    ref, ref_rows = rows_seen(whole)
    out, rows = rows_seen(chunked)
    assert ref_rows == {8} and rows == {3, 2}  # chunks of 3, 3 and 2 prompts
    assert torch.equal(out.queries, ref.queries)
    assert torch.equal(out.responses, ref.responses)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_rollout_generation_batch_size_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="rollout_generation_batch_size=0: invalid value"):
        _args(tmp_path, rollout_generation_batch_size=0)
