"""How PPOTrainer builds its parts, as functions of explicit inputs: input checks, PEFT, the reference
model, quantized copies, the policy-and-value module (with its kernel patches), the prompt datasets and
their order, the optimizer and scheduler, device placement, the callbacks and the memory callback."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import CallbackHandler, PrinterCallback

from rapidfire_hf.models.plumbing import causal_lm_parts, disable_dropout
from rapidfire_hf.optim.optimizer import RapidFireOptimizer
from rapidfire_hf.optim.step_health import rapidfire_optimizer
from rapidfire_hf.ppo.config import check_optimizer_options, check_value_mode
from rapidfire_hf.ppo.data import PromptOrder, collate_prompts, prepare_prompt_dataset, prompt_limits
from rapidfire_hf.ppo.default_optimizer import default_adamw, default_adamw_kernel, default_scheduler
from rapidfire_hf.ppo.modeling import PolicyAndValue, check_value_model, value_head_dtype
from rapidfire_hf.ppo.quantized import is_quantized, quantized_copy
from rapidfire_hf.ppo.seeds import init_lora, new_value_head, prompt_order
from rapidfire_hf.ppo.speedups import KernelPatches, all_sdpa, apply_liger, compile_layers
from rapidfire_hf.utils.device_memory import device_capacity_bytes

logger = logging.getLogger("rapidfire_hf.ppo.trainer")  # PPOTrainer's logger: one name for its messages


def _split_value_head_model(model, value_model):
    """``(policy, v_head)`` of a value-head model (``AutoModelForCausalLMWithValueHead``), else ``(model, None)``.

    Its ``v_head`` becomes the fused value head, so a separate ``value_model`` beside it is refused.
    """
    from rapidfire_hf.models import PreTrainedModelWrapper

    if not isinstance(model, PreTrainedModelWrapper):
        return model, None
    if value_model is not None:
        raise ValueError(
            f"model is a {type(model).__name__}, whose v_head is trained as the value head: pass value_model=None, "
            "or pass model.pretrained_model with the separate value_model"
        )
    return model.pretrained_model, model.v_head


# Typical size of the PPO loss (clipped surrogate over whitened advantages, plus vf_coef x value loss):
# the loss-spike rule of a RapidFireOptimizer never divides by less (rapidfire_hf.optim.health).
PPO_LOSS_SCALE = 1.0


def _as_list(funcs) -> list:
    if funcs is None:
        return []
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]


def check_inputs(args, tok, model, ref_model, reward_model, reward_funcs, optimizer, optimizers, value_model):
    """Refuse inputs PPOTrainer cannot train with, each with the fix."""
    if tok is None or getattr(tok, "pad_token_id", None) is None:
        raise ValueError(
            "processing_class has no pad token: set one before building the trainer, e.g. "
            "`tokenizer.add_special_tokens({'pad_token': '<pad>'})` and resize the model's embeddings "
            "(reusing the EOS token as pad would mask real EOS tokens)."
        )
    if (reward_model is None) == (not _as_list(reward_funcs)):
        raise ValueError(
            "Give exactly one of reward_model (a sequence-classification model) and reward_funcs "
            f"(callables returning one float per completion); got reward_model={type(reward_model).__name__}, "
            f"reward_funcs={reward_funcs!r}."
        )
    for f in _as_list(reward_funcs):
        if not callable(f):
            raise TypeError(f"reward_funcs entries must be callables, got {type(f).__name__}")
    if optimizer is not None and any(o is not None for o in optimizers):
        raise ValueError("Pass either optimizer= or optimizers=(optimizer, scheduler), not both.")
    if ref_model is not None and ref_model is model:
        raise ValueError(
            "ref_model is the same object as model: pass ref_model=None (a frozen copy is made)."
        )
    if value_model is not None and value_model is model:
        raise ValueError(
            "value_model is the same object as model: use PPOConfig(value_mode='fused') instead."
        )
    check_value_mode(args, value_model)
    if args.stop_token == "eos" and tok.eos_token_id is None:
        raise ValueError("stop_token='eos' but the tokenizer has no eos_token: set stop_token_id instead.")
    stop = tok.eos_token_id if args.stop_token == "eos" else args.stop_token_id
    if stop is not None and stop == tok.pad_token_id:
        raise ValueError(
            f"The stop token id {stop} is also the pad token: PPO masks pad tokens, so the stop token would "
            "vanish. Give the tokenizer a distinct pad token."
        )


def reward_functions(args, reward_funcs) -> list:
    """``reward_funcs`` as a list, with one ``reward_weights`` entry per function when weights are given."""
    funcs = _as_list(reward_funcs)
    weights = args.reward_weights
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(weights)} entries but there are {len(funcs)} "
            "reward functions: give one weight per function."
        )
    return funcs


def make_memory_callback(args, rf_config):
    """The memory callback when ``memory_management`` is on."""
    if not args.memory_management:
        return None
    from rapidfire_hf.memory import MemoryCompactionCallback

    cfg = rf_config
    return MemoryCompactionCallback(
        cfg.memory if cfg is not None else None,
        telemetry_dir=getattr(getattr(cfg, "logging", None), "telemetry_dir", None),
    )


def apply_peft(model, peft_config, seed: int = 0):
    """``model`` with a new PEFT adapter from ``peft_config`` (as given without one).

    A plain LoRA adapter with peft's default init (A Kaiming-uniform, B zero) is drawn from ``seed``
    (:func:`rapidfire_hf.ppo.seeds.init_lora`), as a sweep's trial with that seed draws it; other adapters
    keep peft's own init."""
    if peft_config is None:
        return model
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config).__name__}"
        )
    if hasattr(model, "peft_config"):
        raise ValueError(
            "model is already a PeftModel: pass the base model with peft_config, or no peft_config."
        )
    policy = get_peft_model(model, peft_config)
    pairs = _default_lora_pairs(policy, peft_config)
    if pairs is not None:
        init_lora(pairs, seed)
    return policy


def _default_lora_pairs(policy, peft_config) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The ``(A, B)`` weights of each LoRA linear of ``policy`` in module order, when the adapter is plain
    LoRA with peft's default init (the one a sweep's trial draws); else None."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    if not isinstance(peft_config, LoraConfig) or peft_config.init_lora_weights is not True:
        return None
    if peft_config.use_dora or getattr(peft_config, "modules_to_save", None):
        return None
    pairs = []
    for module in policy.modules():
        if not isinstance(module, LoraLayer):
            continue
        name = policy.active_adapter
        if module.lora_embedding_A or name not in module.lora_A:
            return None
        a, b = module.lora_A[name], module.lora_B[name]
        if not (type(a) is torch.nn.Linear and type(b) is torch.nn.Linear):
            return None
        pairs.append((a.weight, b.weight))
    return pairs or None


def select_adapters(args, policy, ref_model, is_peft: bool) -> str | None:
    """Check ``model_adapter_name`` / ``ref_adapter_name`` against the PeftModel's adapters, make the
    training adapter active, and return its name (None without PEFT)."""
    names = {"model_adapter_name": args.model_adapter_name, "ref_adapter_name": args.ref_adapter_name}
    given = {k: v for k, v in names.items() if v is not None}
    if not is_peft:
        if given:
            raise ValueError(
                f"{', '.join(given)} name adapters of a PeftModel, but the model is not one: pass a PeftModel "
                "holding those adapters (peft.PeftModel.from_pretrained + load_adapter), or drop them."
            )
        return None
    adapters = sorted(policy.peft_config)
    for key, name in given.items():
        if name not in adapters:
            raise ValueError(f"{key}={name!r}: the PeftModel has no such adapter (it has {adapters})")
    train = args.model_adapter_name or policy.active_adapter
    if args.ref_adapter_name is not None:
        if ref_model is not None:
            raise ValueError(
                f"ref_adapter_name={args.ref_adapter_name!r} and a ref_model were both given: the reference "
                "is one or the other; drop one."
            )
        if args.ref_adapter_name == train:
            raise ValueError(
                f"ref_adapter_name={args.ref_adapter_name!r} is the adapter being trained: the reference must "
                "be another adapter (or None: the adapter-disabled base)."
            )
    if args.model_adapter_name is not None:
        policy.set_adapter(train)  # the adapter trained; set_adapter makes only it require gradients
    return train


def check_generation_gather(args, accelerator) -> None:
    """Refuse ``ds3_gather_for_generation=False`` under ZeRO-3 (the rollout engine needs whole weights)."""
    from rapidfire_hf.distributed.features import Engine, detect_engine

    if not args.ds3_gather_for_generation and detect_engine(accelerator) is Engine.ZERO3:
        raise ValueError(
            "ds3_gather_for_generation=False (generation from ZeRO-3-sharded weights) is not supported: "
            "rapidfire's rollout engine generates from gathered weights. Keep it True; for a policy larger "
            "than one GPU, bound the KV cache with rollout_generation_batch_size or use FSDP2."
        )


def make_reference(args, policy, ref_model, is_peft: bool, device, bits: str | None = None):
    """The frozen reference: ``ref_model``, a copy of the policy (in ``bits``: ``ref_model_quantization`` with
    ``"auto"`` resolved, ``ppo/recipe/frozen_auto.py``), or None with LoRA (the adapter-disabled policy)."""
    if is_peft:
        if bits is not None:
            raise ValueError(
                f"ref_model_quantization={bits!r} with LoRA: the reference is the adapter-disabled policy "
                "itself, not a separate model. Quantize the base model when loading it (QLoRA) instead."
            )
        if ref_model is None:
            return None  # the adapter-disabled policy is the reference
    if ref_model is not None:
        ref_model.requires_grad_(False)
        return maybe_quantize(ref_model, bits, "ref_model_quantization", device)
    if bits is not None:  # a quantized frozen copy, without a full-precision one on the way
        return maybe_quantize(policy, bits, "ref_model_quantization", device)
    ref = copy.deepcopy(policy)
    ref.requires_grad_(False)
    return ref


def maybe_quantize(model, bits: str | None, option: str, device):
    """``model`` as given, or a frozen 8-bit/4-bit copy of it (see :mod:`rapidfire_hf.ppo.quantized`)."""
    if model is None:
        if bits is not None:
            raise ValueError(f"{option}={bits!r} but there is no such model (reward_funcs score instead?)")
        return None
    if bits is None or is_quantized(model):
        return model
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"{option}={bits!r} needs a transformers model (save_pretrained/from_pretrained); got "
            f"{type(model).__name__}. Load it quantized yourself or drop the option."
        )
    logger.info("rapidfire: holding the frozen %s in %s (%s)", type(model).__name__, bits, option)
    return quantized_copy(model, bits, device=device)


def make_module(
    args, accelerator, policy, value_model, given_head, ref_model, reward_model, use_liger: bool
) -> tuple[PolicyAndValue, KernelPatches]:
    """The trained module: the policy with a separate value model, the value head a value-head model
    came with, or a new value head (``value_mode='fused'``). Dropout is turned off in it and in the
    frozen models, then gradient checkpointing, Liger kernels and ``torch_compile`` are applied."""
    precision = accelerator.mixed_precision
    if value_model is not None:
        check_value_model(value_model, policy)
        module = PolicyAndValue(policy, value_model=value_model)
    elif given_head is not None:
        module = PolicyAndValue(policy, value_head=given_head.to(value_head_dtype(policy, precision)))
    elif args.value_mode == "fused":  # drawn from the seed, as a sweep's trial draws its head
        head = new_value_head(causal_lm_parts(policy)[0].config.hidden_size, args.seed)
        module = PolicyAndValue(policy, value_head=head.to(value_head_dtype(policy, precision)))
    else:
        raise ValueError(
            "value_model is None: pass a value model (e.g. AutoModelForSequenceClassification with num_labels=1) "
            "or set PPOConfig(value_mode='fused') to train a value head on the policy."
        )
    for m in (module, ref_model, reward_model):
        if m is not None:
            disable_dropout(m)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    # after the reference copy (a deepcopy of patched or compiled modules is not one) and PEFT
    patches = KernelPatches()
    roles = {"policy": policy, "value_model": value_model, "ref_model": ref_model}
    if use_liger:
        apply_liger(roles, args.liger_kernel_config, patches, compiled=args.torch_compile)
    if args.torch_compile:
        compile_layers(roles, args.torch_compile_backend, args.torch_compile_mode, patches)
        module.full_mask = all_sdpa(roles)  # one mask kind for the compiled layers: no recompiles
    return module, patches


@dataclass
class Prompts:
    """The tokenized prompts of a run and their order."""

    train_dataset: object
    eval_dataset: object | None
    data_collator: Callable[[list], dict]
    prompt_order: PromptOrder
    num_updates: int  # max_steps, else total_episodes or num_train_epochs worth of prompts


def prepare_prompts(
    args, accelerator, tok, pad_token_id: int, policy, train_dataset, eval_dataset, data_collator
) -> Prompts:
    """The tokenized train and eval prompts, their collator, the prompt order over the ranks and the
    number of updates (``max_steps``, else ``total_episodes`` or ``num_train_epochs`` of prompts)."""
    acc = accelerator
    limits = prompt_limits(policy, args.response_length)  # ids in the vocabulary, prompts that fit
    limits["num_proc"] = args.dataset_num_proc
    train = prepare_prompt_dataset(
        train_dataset, tok, args.dataset_text_field, args.max_prompt_length, **limits
    )
    # As in TRL's PPO, the eval prompts serve the sample tables of `num_sample_generations`.
    evaluation = None
    if eval_dataset is not None:
        evaluation = prepare_prompt_dataset(
            eval_dataset,
            tok,
            args.dataset_text_field,
            args.max_prompt_length,
            name="eval_dataset",
            **limits,
        )
    order = prompt_order(
        len(train), args.local_batch_size * acc.num_processes, args.seed, acc.process_index, acc.num_processes
    )
    total = args.total_episodes or int(args.num_train_epochs * len(train))
    num_updates = (
        args.max_steps
        if args.max_steps > 0
        else max(1, math.ceil(total / (args.local_batch_size * acc.num_processes)))
    )
    collator = data_collator or (lambda rows: collate_prompts(rows, pad_token_id))
    return Prompts(train, evaluation, collator, order, num_updates)


def prepare_models(args, accelerator, module, optimizer, ref_model, reward_model) -> tuple:
    """``accelerate.prepare`` of the trained module and the optimizer; the frozen models go to the device
    in eval mode. Returns ``(model, optimizer, ref_model, reward_model)``."""
    acc = accelerator
    ds_plugin = getattr(acc.state, "deepspeed_plugin", None)
    if ds_plugin is not None and ds_plugin.is_auto("train_micro_batch_size_per_gpu"):
        # accelerate reads this from a prepared dataloader; PPO prepares none (prompts are indexed).
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    model, optimizer = acc.prepare(module, optimizer)

    def placed(frozen):  # bitsandbytes models are placed at load time and refuse .to()
        if frozen is None:
            return None
        return (frozen if is_quantized(frozen) else frozen.to(acc.device)).eval()

    return model, optimizer, placed(ref_model), placed(reward_model)


def make_callback_handler(
    args, memory_callback, callbacks, model, tok, optimizer, scheduler
) -> CallbackHandler:
    """transformers' default callbacks, those of ``report_to``, the progress bar (or printer), the
    memory callback and ``callbacks``, in that order."""
    reporting = get_reporting_integration_callbacks(args.report_to)
    progress = PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK
    return CallbackHandler(
        DEFAULT_CALLBACKS
        + reporting
        + [progress]
        + [c for c in [memory_callback] if c]
        + list(callbacks or []),
        model,
        tok,
        optimizer,
        scheduler,
    )


def make_optimizer(args, rf_config, accelerator, module, optimizer, optimizers, num_updates: int, frozen=()):
    """The optimizer (the one given, bound to the trained parameters when built without them; else a
    RapidFireOptimizer from the rapidfire config, else torch AdamW) and its LR scheduler.

    Returns:
        ``(optimizer, scheduler, is_default, state_decision)``: ``is_default`` when the trainer built it
        (``enable_rapidfire`` may rebuild it), ``state_decision`` the 8-bit-state choice of a
        config-built optimizer (None otherwise).
    """
    optimizer = optimizer if optimizer is not None else optimizers[0]
    scheduler = optimizers[1]
    is_default = optimizer is None  # enable_rapidfire may rebuild a default one
    decision = None
    params = [p for p in module.parameters() if p.requires_grad]
    if optimizer is None and rf_config is not None:
        decision = plan_optimizer_state(rf_config, accelerator, params, [module, *frozen])
        optimizer = optimizer_from_config(args, rf_config, params, decision)
    if optimizer is None:
        kernel = default_adamw_kernel(accelerator.device, accelerator.distributed_type)
        optimizer = default_adamw(args, params, **kernel)
    elif isinstance(optimizer, RapidFireOptimizer) and not optimizer.is_bound:
        # what the optimizer was built without comes from PPOConfig, as for the default AdamW
        optimizer.bind(
            params,
            defaults={
                "lr": args.learning_rate,
                "betas": (args.adam_beta1, args.adam_beta2),
                "eps": args.adam_epsilon,
                "weight_decay": args.weight_decay,
            },
        )
        if (
            optimizer.pipeline_enabled
            and optimizer.max_grad_norm is None
            and args.max_grad_norm
            and args.max_grad_norm > 0
        ):
            # clip_grad_norm_ after backward would come too late for pipelined buckets: the
            # optimizer clips instead, with PPOConfig's max_grad_norm (0 there turns clipping off)
            optimizer.set_max_grad_norm(args.max_grad_norm)
            optimizer.defaults_taken = {
                **optimizer.defaults_taken,
                "max_grad_norm": args.max_grad_norm,
            }
    rapidfire = rapidfire_optimizer(optimizer)
    if rapidfire is not None:  # ppo/optimization.py replays what a missed clip prediction skipped
        rapidfire.replays_missed_windows = True
        # the PPO loss is signed and near zero (whitened advantages): judge spikes on the scale of 1
        rapidfire.set_loss_scale(PPO_LOSS_SCALE)
    if (
        rapidfire is not None
        and rapidfire.pipeline_enabled
        and rapidfire.max_grad_norm is None
        and args.max_grad_norm
        and args.max_grad_norm > 0
    ):
        logger.warning(
            "max_grad_norm=%s is applied by clip_grad_norm_ after backward; with a gradient pipeline the "
            "pipelined gradients are already applied then. Pass RapidFireOptimizer(max_grad_norm=...) instead "
            "(or build it without parameters: PPOTrainer then hands it PPOConfig's max_grad_norm).",
            args.max_grad_norm,
        )
    check_optimizer_options(args, rapidfire is not None)
    if rapidfire is not None and args.approx_kl_limit is not None:
        limit = args.approx_kl_limit
        rapidfire.add_rule("approx_kl", lambda m: m["approx_kl"] < limit)
    if scheduler is None:
        scheduler = default_scheduler(args, optimizer, num_updates)
    return optimizer, scheduler, is_default, decision


def plan_optimizer_state(rf_config, accelerator, params, models) -> tuple[bool, str]:
    """8-bit AdamW state for the optimizer the trainer builds? (``memory.optimization`` as a target:
    ``rapidfire_hf.memory.planner.choose_optimizer_state``; only on a CUDA device, which is where
    bitsandbytes' 8-bit AdamW runs.)"""
    from rapidfire_hf.memory.planner import LEVEL_TARGETS, choose_optimizer_state
    from rapidfire_hf.utils.imports import is_available

    device = accelerator.device
    if device.type != "cuda":
        return False, "fits"
    seen, model_bytes = set(), 0
    for m in models:
        if not isinstance(m, torch.nn.Module):
            continue
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                model_bytes += t.numel() * t.element_size()
    grads = sum(p.numel() * p.element_size() for p in params)
    level = rf_config.memory.optimization
    target = int(LEVEL_TARGETS[level.value].device_share * device_capacity_bytes(device))
    available = is_available("bitsandbytes")
    return choose_optimizer_state(level, model_bytes, grads, 2 * grads, 2 * sum(p.numel() for p in params),
                                  target, available)  # fmt: skip


def span_steps(args, sync_interval: int) -> int:
    """``gradient.sync_interval`` for one PPO update: at most the update's optimizer steps.

    The trainer verifies every step of an update before the next rollout (``verify_now``), so a span never
    holds more steps than an update takes. A span applies its steps first and keeps a snapshot of every
    parameter and its AdamW state to undo them; with one step per update that snapshot buys nothing over
    verifying the step before it applies (one host read). At 1.1B batch 8 (one step per update)
    ``aggressive``'s span of 4 held a 12 GiB snapshot (peak 41.4 GiB against 29.4 for ``balanced``,
    benchmarks/presets/results/h200/b8) and copied it every update.
    """
    return max(1, min(sync_interval, args.num_ppo_epochs * args.num_mini_batches))


def optimizer_from_config(args, rf_config, params, decision: tuple[bool, str]):
    """A RapidFireOptimizer with the trainer's hyper-parameters and the rapidfire config's pipeline."""
    from rapidfire_hf.optim import RapidFireOptimizer

    grad_cfg = rf_config.gradient
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    return RapidFireOptimizer(
        params,
        optimizer="adamw8bit" if decision[0] else "adamw",
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        gradient_pipeline=bool(grad_cfg.pipeline),
        pipeline_bucket_mb=grad_cfg.bucket_mb,
        pipeline_share=grad_cfg.overlap_factor,
        pipeline_depth=grad_cfg.pipeline_depth,
        max_grad_norm=clip,
        rollback="auto",
        sync_interval=span_steps(args, grad_cfg.sync_interval),
        max_consecutive_skips=args.max_consecutive_skips,
        # predicting needs a clip to predict; without max_grad_norm the exact mode is the same
        clip_prediction=grad_cfg.clip_prediction.value if clip is not None else "exact",
        clip_tolerance=grad_cfg.clip_tolerance,
    )
