"""The settings contract: what ``PPOTrainer``, ``PPOSweep`` and ``enable_rapidfire`` do with every setting.

One row per ``PPOConfig`` field (:func:`field_rows`, ``rapidfire_hf.ppo.field_facts.PPO_ROWS``: the fields
PPOConfig declares carry their rows in their metadata, those it inherits from ``TrainingArguments`` have theirs
in ``TRAINING_ARGS_ROWS``), per
rapidfire config field (``CONFIG_ROWS``, keyed ``section.field``) and per ``RAPIDFIRE_*`` environment variable (``ENV_ROWS``). Each row says, for each
entry point, one of:

- ``applied``: the entry point acts on the value (``how`` says where, or what it caps or rewrites; a cap or
  rewrite is said once in the start table);
- ``refused``: a value the entry point does not act on raises a ``ConfigError`` naming the setting before
  any model moves (``why`` is the message; ``accepts`` lists values that are what the entry point does
  anyway, accepted without a word);
- ``n/a``: the entry point never receives the setting (``why`` says where it goes instead).

tests/config/test_contract.py walks every dataclass field and every variable the code reads: a setting
without a row fails CI. The refusals below are the only place a "does not apply" decision is made; the
entry points call :func:`ppo_refusals`, :func:`config_refusals` and :func:`env_refusals` and raise what
they return.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from rapidfire_hf.config.errors import ConfigError, ConfigErrors

TRAINER, SWEEP, ENABLE = "PPOTrainer", "PPOSweep", "enable_rapidfire"
ENTRY_POINTS = (TRAINER, SWEEP, ENABLE)


@dataclass(frozen=True)
class Use:
    """What one entry point does with one setting."""

    verdict: str  # "applied" | "refused" | "n/a"
    why: str = ""
    accepts: tuple = ()  # refused only: values that are what the entry point does anyway


def applied(how: str = "") -> Use:
    return Use("applied", how)


def refused(why: str, accepts: tuple = ()) -> Use:
    return Use("refused", why, accepts)


def na(why: str) -> Use:
    return Use("n/a", why)


# PPOConfig reaches enable_rapidfire only inside a PPOTrainer (other trainers take their own config class)
_VIA_TRAINER = na("reaches enable_rapidfire only inside a PPOTrainer, which applied or refused it when built")
_NO_EVAL = "PPOTrainer has no evaluation loop (eval_dataset serves the num_sample_generations tables)"
_NO_LOADER = "prompts are indexed, not loaded by a DataLoader (memory.prefetch_window prefetches them)"
_NO_DIST_ARGS = "the accelerator is built from `accelerate launch`'s configuration, not from these arguments"
SWEEP_ONE_PROCESS = "a sweep trains every trial in one process on one device"
_ADAMW = ("adamw_torch", "adamw_torch_fused")


def row(trainer: Use, sweep: Use, enable: Use = _VIA_TRAINER) -> dict[str, Use]:
    return {TRAINER: trainer, SWEEP: sweep, ENABLE: enable}


def both(use: Use) -> dict[str, Use]:
    return row(use, use)


APPLIED = applied()

# The metadata key under which a dataclass field declares its own row (PPOConfig's fields: ``contract=`` in
# ``facts(...)``, rapidfire_hf/ppo/config.py); :func:`field_rows` reads it.
CONTRACT_KEY = "contract"

# The rows of the ``transformers.TrainingArguments`` fields PPOConfig inherits without declaring them again. A
# field PPOConfig declares carries its own row (under ``CONTRACT_KEY`` in its metadata); :func:`field_rows`
# puts the two together, one row per PPOConfig field (``rapidfire_hf.ppo.field_facts.PPO_ROWS``).
TRAINING_ARGS_ROWS: dict[str, dict[str, Use]] = {
    "output_dir": both(APPLIED),
    "per_device_train_batch_size": both(APPLIED),
    "num_train_epochs": both(APPLIED),
    "max_steps": both(APPLIED),
    "lr_scheduler_type": both(APPLIED),
    "lr_scheduler_kwargs": both(APPLIED),
    "warmup_steps": both(APPLIED),
    "optim": row(
        refused("PPOTrainer trains with torch AdamW: pass optimizer=... for another one", _ADAMW),
        refused("every sweep trial trains with torch AdamW", _ADAMW),
    ),
    "optim_args": both(refused("only transformers' Trainer reads it; pass optimizer=... instead")),
    "optim_target_modules": both(refused("only transformers' Trainer reads it (GaLore / APOLLO)")),
    "weight_decay": both(APPLIED),
    "adam_beta1": both(APPLIED),
    "adam_beta2": both(APPLIED),
    "adam_epsilon": both(APPLIED),
    "gradient_accumulation_steps": both(APPLIED),
    "average_tokens_across_devices": both(refused("the PPO losses are averaged per mini-batch, as in TRL")),
    "max_grad_norm": both(APPLIED),
    "label_smoothing_factor": both(refused("the PPO loss has no labels to smooth")),
    "bf16": row(applied("accelerate's mixed precision"), applied("autocast on CUDA; refused on the CPU")),
    "fp16": row(applied("accelerate's mixed precision"), applied("autocast on CUDA; refused on the CPU")),
    "bf16_full_eval": both(refused(_NO_EVAL)),
    "fp16_full_eval": both(refused(_NO_EVAL)),
    "tf32": both(applied("transformers sets torch's TF32 switches when the PPOConfig is built")),
    "activation_checkpointing": row(
        applied("transformers copies it to gradient_checkpointing"),
        refused("the sweep's forwards do not recompute activations"),
    ),
    "activation_checkpointing_kwargs": row(
        applied("transformers copies it to gradient_checkpointing_kwargs"),
        refused("the sweep's forwards do not recompute activations"),
    ),
    "gradient_checkpointing": row(APPLIED, refused("the sweep's forwards do not recompute activations")),
    "gradient_checkpointing_kwargs": row(APPLIED, refused("the sweep's forwards do not recompute activations")),
    "torch_compile": row(APPLIED, refused("the sweep's forwards are not compiled")),
    "torch_compile_backend": row(APPLIED, refused("the sweep's forwards are not compiled")),
    "torch_compile_mode": row(APPLIED, refused("the sweep's forwards are not compiled")),
    "use_liger_kernel": row(APPLIED, refused("the sweep's forwards run the model's own kernels")),
    "liger_kernel_config": row(APPLIED, refused("the sweep's forwards run the model's own kernels")),
    "use_cache": both(refused("the rollout engine keeps its own KV cache; training forwards use none")),
    "neftune_noise_alpha": both(refused("no noise is added to the embeddings of a PPO run")),
    "torch_empty_cache_steps": both(
        refused("a rapidfire config's memory section decides when the allocator cache is released")
    ),
    "auto_find_batch_size": both(refused("max_oom_splits halves a micro-batch that runs out of memory")),
    "logging_strategy": row(
        applied("transformers' flow callback"), refused("a sweep logs every logging_steps", ("steps",))
    ),
    "logging_first_step": row(applied("transformers' flow callback"), refused("a sweep logs every logging_steps")),
    "log_on_each_node": both(refused("metrics are logged from the main process")),
    "logging_nan_inf_filter": both(refused("PPO metrics are logged as they are")),
    "include_num_input_tokens_seen": both(refused("not counted by PPO", accepts=("no", False))),  # False: "no"
    "log_level": both(refused("logging.level of a rapidfire config sets rapidfire's logger")),
    "log_level_replica": both(refused("logging.level of a rapidfire config sets rapidfire's logger")),
    "disable_tqdm": row(APPLIED, na("PPOSweep(progress=...) decides whether the sweep's live table is drawn")),
    "report_to": both(APPLIED),
    "run_name": row(APPLIED, refused("each trial's tracker run is named after the trial")),
    "project": row(applied("transformers' trackio callback"), refused("a sweep logs to TensorBoard or W&B")),
    "trackio_space_id": row(applied("transformers' trackio callback"), refused("a sweep logs to TensorBoard or W&B")),
    "trackio_bucket_id": row(applied("transformers' trackio callback"), refused("a sweep logs to TensorBoard or W&B")),
    "trackio_static_space_id": row(
        applied("transformers' trackio callback"), refused("a sweep logs to TensorBoard or W&B")
    ),
    "eval_strategy": both(refused(_NO_EVAL)),
    "eval_steps": both(refused(_NO_EVAL)),
    "eval_delay": both(refused(_NO_EVAL)),
    "per_device_eval_batch_size": row(
        applied("prompts per sample-table generation"), refused("a sweep writes no sample tables")
    ),
    "prediction_loss_only": both(refused(_NO_EVAL)),
    "eval_on_start": both(refused(_NO_EVAL)),
    "eval_do_concat_batches": both(refused(_NO_EVAL)),
    "eval_use_gather_object": both(refused(_NO_EVAL)),
    "eval_accumulation_steps": both(refused(_NO_EVAL)),
    "include_for_metrics": both(refused(_NO_EVAL)),
    "batch_eval_metrics": both(refused(_NO_EVAL)),
    "save_only_model": both(refused("a checkpoint holds what a resume needs, optimizer included")),
    "save_steps": both(APPLIED),
    "save_on_each_node": both(refused("checkpoints are written by the main process")),
    "save_total_limit": both(APPLIED),
    "enable_jit_checkpoint": both(refused("checkpoints are written every save_steps updates")),
    "push_to_hub": row(
        refused("nothing is pushed during training: call trainer.push_to_hub() after train()"),
        refused("a sweep writes its trials to output_dir only"),
    ),
    "hub_token": row(applied("trainer.push_to_hub()"), refused("a sweep writes its trials to output_dir only")),
    "hub_private_repo": row(
        applied("trainer.push_to_hub()"), refused("a sweep writes its trials to output_dir only")
    ),
    "hub_model_id": row(applied("trainer.push_to_hub()"), refused("a sweep writes its trials to output_dir only")),
    "hub_strategy": both(refused("trainer.push_to_hub() uploads output_dir once, when called")),
    "hub_always_push": both(refused("trainer.push_to_hub() uploads output_dir once, when called")),
    "hub_revision": both(refused("trainer.push_to_hub() uploads to the main branch")),
    "load_best_model_at_end": both(refused(_NO_EVAL)),
    "metric_for_best_model": both(refused(_NO_EVAL)),
    "greater_is_better": both(refused(_NO_EVAL)),
    "ignore_data_skip": both(refused("a resume continues the prompt order where it stopped")),
    "restore_callback_states_from_checkpoint": both(refused("callback states are not saved")),
    "full_determinism": both(refused("runs are seeded from seed (rapidfire_hf.ppo.seeds); not applied")),
    "seed": both(APPLIED),
    "data_seed": both(refused("the prompt order is drawn from seed")),
    "use_cpu": both(APPLIED),
    "accelerator_config": both(refused(_NO_DIST_ARGS)),
    "parallelism_config": both(refused(_NO_DIST_ARGS)),
    "dataloader_drop_last": both(refused(_NO_LOADER)),
    "dataloader_num_workers": both(refused(_NO_LOADER)),
    "dataloader_pin_memory": both(refused(_NO_LOADER)),
    "dataloader_persistent_workers": both(refused(_NO_LOADER)),
    "dataloader_prefetch_factor": both(refused(_NO_LOADER)),
    "dataloader_multiprocessing_context": both(refused(_NO_LOADER)),
    "dataloader_in_order": both(refused(_NO_LOADER)),
    "remove_unused_columns": both(refused("dataset columns are kept for the reward functions")),
    "label_names": both(refused("the PPO loss has no labels")),
    "train_sampling_strategy": both(refused("the prompt order is a seeded permutation per pass")),
    "length_column_name": both(refused("the prompt order is a seeded permutation per pass")),
    "ddp_find_unused_parameters": both(refused(_NO_DIST_ARGS)),
    "ddp_bucket_cap_mb": both(refused(_NO_DIST_ARGS)),
    "ddp_broadcast_buffers": both(refused(_NO_DIST_ARGS)),
    "ddp_static_graph": both(refused(_NO_DIST_ARGS)),
    "ddp_backend": both(refused(_NO_DIST_ARGS)),
    "ddp_timeout": both(refused(_NO_DIST_ARGS)),
    "fsdp": both(refused(_NO_DIST_ARGS + " (accelerate launch --config_file)")),
    "fsdp_config": both(refused(_NO_DIST_ARGS + " (accelerate launch --config_file)")),
    "deepspeed": both(refused(_NO_DIST_ARGS + " (accelerate launch --config_file)")),
    "debug": both(refused("transformers' debug options are not run")),
    "skip_memory_metrics": both(refused("memory is reported by the memory callback (rapidfire/memory/*)")),
    "do_train": both(na("a flag for your script; transformers' trainers do not read it either")),
    "do_eval": both(na("a flag for your script; transformers' trainers do not read it either")),
    "do_predict": both(na("a flag for your script; transformers' trainers do not read it either")),
    "resume_from_checkpoint": both(na("a flag for your script: pass train(resume_from_checkpoint=...)")),
    "local_rank": both(na("set by the launcher")),
}

_SWEEP_RF = "a sweep applies memory.optimization, memory.planner and logging.level of a rapidfire config only"
_NO_REPLAY = "enable_rapidfire's trainers cannot replay a rolled-back window"

CONFIG_ROWS: dict[str, dict[str, Use]] = {
    "gradient.pipeline": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "gradient.pipeline_depth": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "gradient.overlap_factor": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "gradient.sync_interval": row(
        applied("capped at one update's optimizer steps (num_ppo_epochs x num_mini_batches), said at start"),
        refused(_SWEEP_RF),
        refused(_NO_REPLAY + ", so they verify every step (a config file's value is capped at 1, said at start)", (1,)),
    ),
    "gradient.bucket_mb": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "gradient.clip_prediction": row(
        applied("'scale' runs as 'exact' without max_grad_norm, said at start"),
        refused(_SWEEP_RF),
        refused(_NO_REPLAY + ": pass optimizer_kwargs={'clip_prediction': 'scale'} to ask for it", ("exact",)),
    ),
    "gradient.clip_tolerance": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "memory.optimization": both(APPLIED) | {ENABLE: APPLIED},
    "memory.checkpointing": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "memory.planner": row(
        APPLIED, APPLIED, refused("the throughput planner plans PPOTrainer's and PPOSweep's batches only", (True,))
    ),
    "memory.compaction_threshold": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "memory.release_after_rollout": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "memory.prefetch_window": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "memory.lowmem": row(
        refused("the low-memory stack is for TRL's GRPOTrainer/RLOOTrainer through enable_rapidfire", ("off",)),
        refused(_SWEEP_RF, ("off",)),
        APPLIED,
    ),
    "precision.mode": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "precision.initial": row(
        applied("the trainer computes in PPOConfig's bf16/fp16: a dtype asked by name (`precision: bf16`, "
                "RAPIDFIRE_PRECISION_INITIAL) it does not compute in is refused, a different full-form initial is "
                "said in the start table"),
        refused(_SWEEP_RF),
        applied("the trainer computes in its own bf16/fp16 (it owns autocast); a different initial is said in "
                "the start table"),
    ),
    "precision.fallback": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "logging.level": both(APPLIED) | {ENABLE: APPLIED},
    "logging.log_every": row(APPLIED, refused(_SWEEP_RF), APPLIED),
    "logging.report_to": row(
        refused("PPOTrainer logs to PPOConfig's report_to: set it there", ([],)), refused(_SWEEP_RF), APPLIED
    ),
    "logging.wandb_project": row(
        refused("PPOTrainer logs to PPOConfig's report_to (W&B reads WANDB_PROJECT)", (None,)),
        refused(_SWEEP_RF),
        APPLIED,
    ),
    "logging.telemetry_dir": row(applied("the memory callback's telemetry stream"), refused(_SWEEP_RF), APPLIED),
}

_NO_CONFIG = "is read only together with a rapidfire config"
_PLUGIN_ONLY = refused(
    "read only by an AdaptivePrecisionPlugin built directly; the config loader refuses it as unknown"
)
_SWEEP_NO_TELEMETRY = na("a sweep writes no telemetry and registers no process")

# RAPIDFIRE_* variables other than RAPIDFIRE_<SECTION>_<FIELD> (those follow CONFIG_ROWS: see env_row)
OTHER_ENV_ROWS: dict[str, dict[str, Use]] = {
    "RAPIDFIRE_CACHE_DIR": row(applied("the memory callback's process registry"), _SWEEP_NO_TELEMETRY, APPLIED),
    "RAPIDFIRE_TELEMETRY_DIR": row(applied("the memory callback's telemetry stream"), _SWEEP_NO_TELEMETRY, APPLIED),
    "RAPIDFIRE_SYNC_DEBUG": row(
        applied("SyncDebugCallback"), na(SWEEP_ONE_PROCESS + ": there are no ranks to compare"), applied("SyncDebugCallback")
    ),
    "RAPIDFIRE_SYNC_INTERVAL": row(
        applied("with RAPIDFIRE_SYNC_DEBUG, without a rapidfire config (gradient.sync_interval wins)"),
        na(SWEEP_ONE_PROCESS + ": there are no ranks to compare"),
        applied("with RAPIDFIRE_SYNC_DEBUG"),
    ),
    "RAPIDFIRE_SYNC_THRESHOLD": row(
        applied("with RAPIDFIRE_SYNC_DEBUG"), na(SWEEP_ONE_PROCESS + ": there are no ranks to compare"),
        applied("with RAPIDFIRE_SYNC_DEBUG"),
    ),  # fmt: skip
}


# AdaptivePrecisionPlugin's options that are not config fields (precision/options.py DEFAULTS; the config
# layer cannot import it: tests/config/test_contract.py keeps the two equal)
PLUGIN_ONLY_OPTIONS = (
    "sensitive_precision",
    "sensitivity_threshold",
    "sensitivity_batches",
    "auto_switch_layers",
    "rule_cooldown_steps",
    "init_scale",
    "growth_interval",
)


def plugin_env_names() -> list[str]:
    """``RAPIDFIRE_PRECISION_<OPTION>`` names only ``AdaptivePrecisionPlugin`` reads (not config fields)."""
    return [f"RAPIDFIRE_PRECISION_{name.upper()}" for name in PLUGIN_ONLY_OPTIONS]


def env_rows() -> dict[str, dict[str, Use]]:
    """Every ``RAPIDFIRE_*`` variable's row: the config variables follow their field's row (and are refused
    by name without a rapidfire config), the plugin-only ones are refused, the others are listed above."""
    from rapidfire_hf.config.loader import env_variables

    rows = dict(OTHER_ENV_ROWS)
    for name, (section, key) in env_variables().items():
        field_row = CONFIG_ROWS[f"{section}.{key}"]
        rows[name] = {
            TRAINER: field_row[TRAINER]
            if field_row[TRAINER].verdict != "applied"
            else applied(f"with a rapidfire config; refused by name without one ({field_row[TRAINER].why})"),
            SWEEP: field_row[SWEEP],
            ENABLE: field_row[ENABLE],
        }
    for name in plugin_env_names():
        rows[name] = {entry: _PLUGIN_ONLY for entry in ENTRY_POINTS}
    return rows


# ---------------------------------------------------------------------------------------- the checks
def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _declared_default(cls: type, name: str) -> Any:
    import dataclasses

    f = next(f for f in fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


_EMPTY = (None, False, "", [], {})
_REFERENCE: dict[tuple, Any] = {}


def _derived_default(args: Any, name: str) -> Any:
    """The value ``name`` takes in a PPOConfig of ``args``' class given nothing but ``use_cpu``: what
    ``__post_init__`` derives by itself (``dataloader_pin_memory`` off on the CPU, ``debug`` as a list), which
    ``dataclasses.replace`` then passes back as if asked for."""
    key = (type(args), bool(args.use_cpu))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_config(type(args), key[1])
    return getattr(_REFERENCE[key], name)


def _reference_config(cls: type, use_cpu: bool) -> Any:
    """A default config of ``cls``, built without touching the run's distributed state: building a
    ``TrainingArguments`` resets accelerate's shared ``PartialState``/``AcceleratorState`` and derives them again
    from the environment, which undid a state configured before the trainer (found by the CPU FSDP2 smoke of
    benchmarks/distributed: its group fell back to DDP once the trainer checked its settings)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    # accelerate keeps each state as one class-level dict shared by every instance (its only handle)
    saved = [(state, dict(state._shared_state)) for state in (PartialState, AcceleratorState, GradientState)]
    try:
        return cls(output_dir="rapidfire_contract_reference", report_to=[], use_cpu=use_cpu)
    finally:
        for state, before in saved:
            state._shared_state.clear()
            state._shared_state.update(before)


def _refused_value(use: Use, value: Any, defaults: tuple = (None,)) -> bool:
    """Whether ``use`` refuses ``value``: its ``accepts``, else the defaults, are what the entry point does."""
    if use.verdict != "refused":
        return False
    accepts = [_plain(v) for v in (use.accepts or defaults)]
    value = _plain(value)
    if not use.accepts and any(v in _EMPTY for v in accepts) and value in _EMPTY:
        return False  # None, False, "" and [] all say "not used"
    return value not in accepts


def field_rows(cls: type) -> dict[str, dict[str, Use]]:
    """One row per dataclass field of ``cls`` (PPOConfig), in field order: the row its metadata holds under
    ``CONTRACT_KEY``, else ``TRAINING_ARGS_ROWS``'s. A field with neither has no row (the walk of
    tests/config/test_contract.py fails on it)."""
    rows = {}
    for f in fields(cls):
        declared = f.metadata.get(CONTRACT_KEY)
        found = declared if declared is not None else TRAINING_ARGS_ROWS.get(f.name)
        if found is not None:
            rows[f.name] = dict(found)
    return rows


def ppo_refusals(args: Any, entry: str) -> list[ConfigError]:
    """The PPOConfig fields ``entry`` refuses in ``args``, each as an error naming the field."""
    errors = []
    explicit = getattr(args, "explicit_fields", frozenset())
    for name, field_row in field_rows(type(args)).items():
        use = field_row[entry]
        if use.verdict != "refused" or name not in explicit:  # asked for: given by name, or set since
            continue
        value = args.asked_value(name)
        if name == "run_name" and str(value).startswith(f"{args.exp_name}__{args.seed}__"):
            continue  # the name PPOConfig makes up, passed back by dataclasses.replace
        defaults = (_declared_default(type(args), name), _derived_default(args, name))
        if _refused_value(use, value, defaults):
            errors.append(ConfigError(f"{entry} does not apply it: {use.why}", key=name, value=_plain(value)))
    return errors


def _config_default(section: str, name: str) -> Any:
    from rapidfire_hf.config.schema import RapidFireConfig

    return RapidFireConfig().to_dict()[section][name]


def config_refusals(explicit: Mapping[str, tuple[Any, str | None]], entry: str) -> list[ConfigError]:
    """The rapidfire config settings given explicitly (``loader.explicit_settings``) that ``entry`` refuses.

    Args:
        explicit: ``{"section.field": (value, source)}``; ``source`` names an environment variable or None.
        entry: one of ``ENTRY_POINTS``.
    """
    errors = []
    for key, (value, source) in explicit.items():
        use = CONFIG_ROWS[key][entry]
        section, name = key.split(".")
        if _refused_value(use, value, (_config_default(section, name),)):
            errors.append(
                ConfigError(f"{entry} does not apply it: {use.why}", key=key, value=_plain(value), source=source)
            )
    return errors


def env_refusals(entry: str, has_config: bool, environ: Mapping[str, str] | None = None) -> list[ConfigError]:
    """``RAPIDFIRE_*`` variables ``entry`` would not read, or whose values are invalid, as errors naming them.

    Without a rapidfire config (``has_config`` False) PPOTrainer and PPOSweep read no config variable, so
    each one set is refused. With one, the config loader checks them (and ``config_refusals`` the fields).
    """
    from rapidfire_hf.config.loader import env_variables

    environ = os.environ if environ is None else environ
    errors = []
    config_vars = set(env_variables()) | set(plugin_env_names())
    for name in sorted(environ):
        if name in config_vars and not has_config and entry in (TRAINER, SWEEP):
            errors.append(
                ConfigError(
                    f"{_NO_CONFIG}, and this {entry} has none: pass rapidfire_config=... (the variable then "
                    "overrides it) or unset the variable",
                    value=environ[name],
                    source=f"environment variable {name}",
                )
            )
    errors += _sync_env_errors(environ)
    return errors


def _sync_env_errors(environ: Mapping[str, str]) -> list[ConfigError]:
    """Values of the RAPIDFIRE_SYNC_* variables that their reader would fail on (or misread) later."""
    errors = []
    flag = environ.get("RAPIDFIRE_SYNC_DEBUG")
    if flag is not None and flag.strip().lower() not in {"", "0", "1", "true", "false", "yes", "no", "on", "off"}:
        errors.append(
            ConfigError("must be a boolean", value=flag, allowed="1/0, true/false, yes/no, on/off",
                        source="environment variable RAPIDFIRE_SYNC_DEBUG")
        )  # fmt: skip
    for name, kind in (("RAPIDFIRE_SYNC_INTERVAL", int), ("RAPIDFIRE_SYNC_THRESHOLD", float)):
        text = environ.get(name)
        if text is None:
            continue
        try:
            value = kind(text)
            ok = value >= 1 if kind is int else (math.isfinite(value) and value >= 0)
        except ValueError:
            ok = False
        if not ok:
            allowed = "an integer >= 1" if kind is int else "a finite number >= 0"
            errors.append(ConfigError("invalid value", value=text, allowed=allowed, source=f"environment variable {name}"))
    return errors


def raise_refusals(errors: list[ConfigError], entry: str) -> None:
    """Raise ``errors`` together (one names the setting; several are listed), or nothing."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(f"{entry} refuses these settings:", errors)


def field_names(cls: type) -> list[str]:
    """The dataclass fields of ``cls`` (a PPOConfig class) that the contract must cover."""
    return [f.name for f in fields(cls)]
