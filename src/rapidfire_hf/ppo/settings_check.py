"""The settings contract (``rapidfire_hf.config.contract``) checked where each entry point starts.

Each function raises a ``ConfigError`` naming every setting the entry point would not apply, before any
model is moved or copied; ``start_notes`` gives the caps and rewrites the start table says once.
"""

from __future__ import annotations

import os
from typing import Any

from rapidfire_hf.config.contract import (
    ENABLE,
    SWEEP,
    TRAINER,
    config_refusals,
    env_refusals,
    ppo_refusals,
    raise_refusals,
)
from rapidfire_hf.config.errors import ConfigError


def explicit_config(src: Any) -> dict:
    """``{"section.field": (value, source)}`` a rapidfire config source gives by name ({} for None)."""
    from rapidfire_hf.config.loader import explicit_settings

    return {} if src is None else explicit_settings(src)


def trainer_precision_name(args, optimizer=None) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: what PPOTrainer computes in (PPOConfig, or the optimizer's)."""
    from rapidfire_hf.ppo.compat import optimizer_precision

    return {"bf16": "bf16", "fp16": "fp16"}.get(optimizer_precision(args, optimizer), "fp32")


def precision_refusal(src: Any, runs_in: str, entry: str, fix: str) -> list[ConfigError]:
    """A compute precision asked for by name (``precision: bf16``, ``RAPIDFIRE_PRECISION_INITIAL``) that the
    trainer's autocast does not compute in (a full-form ``precision.initial`` is said in the start table)."""
    from rapidfire_hf.config.loader import asked_dtype

    asked = asked_dtype(src)
    if asked is None or asked[0] == runs_in:
        return []
    return [
        ConfigError(
            f"{entry} computes in {runs_in} ({fix}), and the precision plugin cannot change the trainer's "
            f"autocast: make the two agree or drop it ({asked[1]})",
            key="precision.initial",
            value=asked[0],
        )
    ]


def static_engine_refusal(args, model) -> list[ConfigError]:
    """``rollout_backend="static"`` for a model the static engine cannot run by its native or its generic
    forward (asked before any work; PPOTrainer's engine and PPOSweep's batched decode alike)."""
    if args.rollout_backend != "static" or model is None:
        return []
    from rapidfire_hf.rollout.engine import choose_decode_path

    lm = getattr(model, "pretrained_model", model)  # a value-head wrapper generates with its LM
    path, reason = choose_decode_path(lm)  # native, or the generic path (the model's own forward)
    if path is not None:
        return []
    return [
        ConfigError(
            f"the static engine cannot run this model ({reason})",
            key="rollout_backend",
            value="static",
            allowed="'hf' or 'auto' (model.generate for this model)",
        )
    ]


# Triton compiles fp8 e4m3 (``tl.float8e4nv``) for compute capability 8.9 and later only (Ada, Hopper): on an
# A100 neither the flash-decoding kernel nor torch.compile's generated kernels of the decode step can read or
# write an fp8 cache ("fp8e4nv data type is not supported on CUDA arch < 89", triton-lang/triton#4319)
FP8_TRITON_CAPABILITY = (8, 9)


def kv_cache_refusal(
    args, model, auto_runs_hf: str | None = None, capability: tuple[int, int] | None = None
) -> list[ConfigError]:
    """``rollout_kv_cache_dtype="fp8"`` / ``"int8"`` where the rollout cannot keep an 8-bit cache: only the
    static engine's native decode path writes one (``model.generate`` keeps its own cache; the generic path
    runs the model's own attention over it). Asked before any work, so the run never generates with the
    model's dtype in its place.

    Args:
        args: the PPOConfig.
        model: the policy as passed (None: nothing to check yet).
        auto_runs_hf: why ``rollout_backend="auto"`` runs ``model.generate`` for this entry point whatever
            the model (PPOTrainer: not on CUDA, or ZeRO-3), or None (it runs the static engine where the
            model's family allows).
        capability: the CUDA device's compute capability (None: not a CUDA device; torch's own fp8 casts
            run on the CPU).
    """
    from rapidfire_hf.ppo.config import engine_kv_cache_dtype

    asked = args.rollout_kv_cache_dtype
    if model is None or engine_kv_cache_dtype(asked) is None:
        return []
    from rapidfire_hf.rollout.engine import choose_decode_path

    path, reason = choose_decode_path(getattr(model, "pretrained_model", model))
    if args.rollout_backend == "hf":
        why = "rollout_backend='hf' runs model.generate, which keeps its own cache"
    elif args.rollout_backend == "auto" and auto_runs_hf is not None:
        why = f"rollout_backend='auto' runs model.generate here ({auto_runs_hf})"
    elif path is None:
        why = f"model.generate runs this model ({reason})"
    elif path == "generic":
        why = f"this model runs the generic path, the model's own attention over the cache ({reason})"
    elif asked == "fp8" and capability is not None and tuple(capability) < FP8_TRITON_CAPABILITY:
        major, minor = capability
        return [
            ConfigError(
                "the decode step's Triton code (the attention kernel, torch.compile's kernels) reads and writes "
                f"fp8 (e4m3) on compute capability 8.9 or later; this GPU is {major}.{minor}",
                key="rollout_kv_cache_dtype",
                value=asked,
                allowed="'int8' (any GPU), 'auto' or 'model'",
            )
        ]
    else:
        return []
    return [
        ConfigError(
            f"an 8-bit KV cache needs the static engine's native decode path: {why}",
            key="rollout_kv_cache_dtype",
            value=asked,
            allowed="'auto' or 'model' (the model's dtype) for this run",
        )
    ]


def cuda_capability(device) -> tuple[int, int] | None:
    """The compute capability of ``device`` when it is a CUDA device, else None."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device.index if device.index is not None else None)


def check_trainer_kv_cache(args, model, accelerator) -> None:
    """PPOTrainer, once its accelerator says the device and the engine (no model moved yet): refuse an 8-bit
    KV cache its rollout cannot keep (:func:`kv_cache_refusal`).

    Raises:
        ConfigError: naming ``rollout_kv_cache_dtype``.
    """
    from rapidfire_hf.distributed.features import Engine, detect_engine

    # why "auto" runs model.generate whatever the model (ppo.rollout_phase.rollout_backend, resolved_backend)
    device = accelerator.device
    if detect_engine(accelerator) is Engine.ZERO3:
        auto_runs_hf = "DeepSpeed ZeRO-3"
    elif device.type != "cuda":
        auto_runs_hf = (
            f"the static engine records CUDA graphs and this run is on {device.type}; "
            "rollout_backend='static' runs it there"
        )
    else:
        auto_runs_hf = None
    errors = kv_cache_refusal(args, model, auto_runs_hf, cuda_capability(device))
    raise_refusals(errors, TRAINER)


def check_trainer_settings(args, model=None, optimizer=None) -> None:
    """PPOTrainer: every PPOConfig field, rapidfire config field and variable applied or refused by name.

    Args:
        args: the PPOConfig (checked again: a field set after construction is caught here).
        model: the policy as passed (for ``rollout_backend="static"``).
        optimizer: the optimizer passed to the trainer, or None (it built its own).

    Raises:
        ConfigError: naming each refused setting.
    """
    args.validate()
    errors = ppo_refusals(args, TRAINER)
    errors += env_refusals(TRAINER, args.rapidfire_config is not None)
    errors += static_engine_refusal(args, model)
    raise_refusals(errors, TRAINER)
    raise_refusals(check_trainer_config(args, args.rapidfire_config, optimizer), TRAINER)


def check_trainer_config(args, src: Any, optimizer=None) -> list[ConfigError]:
    """The rapidfire config settings a PPOTrainer would not apply (also for ``enable_rapidfire`` on one)."""
    explicit = explicit_config(src)
    errors = config_refusals(explicit, TRAINER)
    runs_in = trainer_precision_name(args, optimizer)
    errors += precision_refusal(src, runs_in, TRAINER, f"PPOConfig bf16={args.bf16}, fp16={args.fp16}")
    if optimizer is not None and getattr(optimizer, "is_bound", True) is not False:
        for key, (value, source) in explicit.items():
            if key.startswith("gradient."):
                errors.append(
                    ConfigError(
                        "PPOTrainer keeps the optimizer passed to it, which was built without the config: build "
                        "RapidFireOptimizer(...) with this setting, or pass no optimizer",
                        key=key,
                        value=value,
                        source=source,
                    )
                )
    return errors


def check_sweep_settings(args, model=None) -> None:
    """PPOSweep: every shared PPOConfig field, rapidfire config field and variable applied or refused.

    Raises:
        ConfigError: naming each refused setting.
    """
    import torch

    args.validate()
    errors = ppo_refusals(args, SWEEP)
    errors += env_refusals(SWEEP, args.rapidfire_config is not None)
    errors += static_engine_refusal(args, model)
    on_cuda = torch.cuda.is_available() and not args.use_cpu
    # the sweep's "auto" backend runs the static engine on any device
    capability = torch.cuda.get_device_capability() if on_cuda else None
    errors += kv_cache_refusal(args, model, None, capability)
    for name in ("bf16", "fp16"):
        if getattr(args, name) and not on_cuda:
            errors.append(
                ConfigError(
                    "a sweep autocasts on CUDA only, and this one runs on the CPU: drop it (the CPU sweep "
                    "computes in the model's dtype)",
                    key=name,
                    value=True,
                )
            )
    errors += config_refusals(explicit_config(args.rapidfire_config), SWEEP)
    raise_refusals(errors, SWEEP)


def check_enable_settings(cfg_src: Any, optimizer_kwargs: dict | None) -> list[str]:
    """enable_rapidfire on a transformers/TRL trainer: the config settings it would not apply.

    A config file (``config/advanced.yaml`` lists every key) that sets ``gradient.sync_interval`` above 1 is
    capped at 1 and said in the start table, as ``PPOTrainer`` says the precision a full file names; given
    by name in a dict, the short form or a variable it is refused.

    Returns:
        The start table's lines for what a setting of the file capped.

    Raises:
        ConfigError: naming each refused setting.
    """
    from rapidfire_hf.config.presets import PRESETS

    explicit = explicit_config(cfg_src) if cfg_src is not None else explicit_config({})
    kwargs = optimizer_kwargs or {}
    for key, option in (("gradient.clip_prediction", "clip_prediction"), ("gradient.sync_interval", "sync_interval")):
        if option in kwargs:  # asked for through optimizer_kwargs: applied there
            explicit.pop(key, None)
    notes = []
    from_file = isinstance(cfg_src, (str, os.PathLike)) and cfg_src not in PRESETS
    value, source = explicit.get("gradient.sync_interval", (1, None))
    if from_file and source is None and value != 1:
        explicit.pop("gradient.sync_interval")
        notes.append(
            f"gradient.sync_interval={value} runs as 1 ({cfg_src}: TRL's trainers cannot replay a rolled-back "
            "window, so every step is verified)"
        )
    errors = config_refusals(explicit, ENABLE)
    errors += env_refusals(ENABLE, True)
    raise_refusals(errors, ENABLE)
    return notes


def start_notes(args, rf_config, rapidfire_optimizer, mixed_precision: str) -> list[str]:
    """What a setting capped or rewrote, said once in PPOTrainer's start table (``mixed_precision``: the
    accelerator's, ``"no"``, ``"bf16"`` or ``"fp16"``)."""
    runs_in = {"bf16": "bf16", "fp16": "fp16"}.get(mixed_precision, "fp32")
    notes = []
    if rf_config is None:
        return notes
    grad = rf_config.gradient
    if rapidfire_optimizer is not None:
        span = getattr(rapidfire_optimizer, "sync_interval", grad.sync_interval)
        if span != grad.sync_interval:
            notes.append(
                f"gradient.sync_interval={grad.sync_interval} runs as {span} (one update's optimizer steps: "
                f"num_ppo_epochs x num_mini_batches = {args.num_ppo_epochs * args.num_mini_batches})"
            )
        clip = getattr(rapidfire_optimizer, "clip_prediction", grad.clip_prediction.value)
        if clip != grad.clip_prediction.value:
            notes.append(
                f"gradient.clip_prediction={grad.clip_prediction.value} runs as {clip} (max_grad_norm="
                f"{args.max_grad_norm}: no clip to predict)"
            )
    if rf_config.precision.initial.value != runs_in:
        notes.append(
            f"precision: computes in {runs_in} (PPOConfig bf16/fp16); the config's precision.initial="
            f"{rf_config.precision.initial.value} is not what runs"
        )
    return notes


def check_unchanged(snapshot: dict[str, str], args, entry: str) -> None:
    """Refuse a PPOConfig changed after ``entry`` was built from it (the parts built then would keep the
    old values), naming each changed field; re-check every field too.

    Raises:
        ConfigError: naming the changed fields.
    """
    from rapidfire_hf.ppo.config import changed_fields

    changed = [name for name in changed_fields(snapshot, args) if name != "rapidfire_config"]
    if changed:
        raise ConfigError(
            f"changed after the {entry} was built from it, which keeps the values it was built with: build a "
            f"new {entry} with the changed PPOConfig",
            key=", ".join(changed),
        )
    args.validate()
