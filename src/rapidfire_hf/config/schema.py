"""The ``RapidFireConfig`` dataclass tree: gradient / memory / precision / logging.

Each section is a dataclass in the style of accelerate's plugins: every field carries
``metadata={"help": ..., "check": ...}``; ``__post_init__`` runs the checks, so an instance is always
valid, and errors name the key path (``memory.compaction_threshold``), the value and what is allowed.
Option sets are ``str`` enums, so ``cfg.memory.optimization == "aggressive"`` works.

The field defaults are the ``balanced`` preset.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

from rapidfire_hf.config.checks import Bool, Check, Choice, Float, Int, OptionalStr, StrList
from rapidfire_hf.config.errors import ConfigError, invalid_value, unknown_key
from rapidfire_hf.config.rules import FallbackRule


class ClipPrediction(str, Enum):
    """What the gradient pipeline does in windows where gradient clipping may bind."""

    EXACT = "exact"
    SCALE = "scale"


class MemoryLevel(str, Enum):
    """How hard memory management works (compaction, activation-checkpointing budget)."""

    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"
    AUTO = "auto"


class Checkpointing(str, Enum):
    """``memory.checkpointing``: activation recompute chosen by the planner, or forced."""

    AUTO = "auto"
    OFF = "off"
    ELEMENTWISE = "elementwise"
    MATMULS = "matmuls"


class RolloutRelease(str, Enum):
    """``memory.release_after_rollout``: when the allocator's cache is released between rollout and training."""

    ALWAYS = "always"
    PRESSURE = "pressure"


class LowMem(str, Enum):
    """``memory.lowmem``: the low-memory GRPO/RLOO stack of ``enable_rapidfire`` (off by default)."""

    OFF = "off"
    ON = "on"
    ON_8BIT_EMBEDDING = "on_8bit_embedding"


class PrecisionMode(str, Enum):
    """``static`` keeps ``initial`` everywhere; ``adaptive`` measures layers and applies fallback rules."""

    STATIC = "static"
    ADAPTIVE = "adaptive"


class DType(str, Enum):
    """Compute precision names."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class LogLevel(str, Enum):
    """Python logging levels, lower-case."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


# Upper bounds of the integer knobs: far above any useful setting, low enough that a typo (an extra
# digit run, 10**30 from a script) is refused instead of queueing, prefetching or waiting that long.
MAX_PIPELINE_DEPTH = 1024  # bucket steps queued on the side stream (a 7B model has ~300 parameters)
MAX_PREFETCH = 64  # rollout batches prepared ahead, each held in memory
MAX_STEP_INTERVAL = 1_000_000  # optimizer steps between verifications / log lines

# experiment trackers logging.report_to accepts (the names transformers' `report_to` uses)
REPORT_TARGETS = ("wandb", "tensorboard", "trackio", "mlflow", "comet_ml")


class RuleList(Check):
    """A list of fallback rules given as ``FallbackRule`` or ``{condition, action}`` mappings.

    Environment text: rules separated by ``;``, each ``<condition> -> <action>``; ``none`` for no rules.
    An empty text is refused rather than read as "no rules", since it would drop the default NaN/Inf rule
    without a word (``VAR=`` in a shell script).
    """

    allowed = (
        "a list of {condition, action} mappings (in the environment: "
        "'<condition> -> <action>; ...', or 'none' for no rules)"
    )

    def __call__(self, key: str, value: Any) -> list[FallbackRule]:
        if not isinstance(value, (list, tuple)):
            self.fail(key, value)
        rules = []
        for index, item in enumerate(value):
            try:
                rules.append(FallbackRule.from_dict(item))
            except ConfigError as err:
                raise err.with_prefix(f"{key}[{index}]") from None
        return rules

    def parse_env(self, text: str) -> Any:
        if text.strip().lower() == "none":
            return []
        if not text.strip():
            return text  # refused by __call__: not a list
        rules = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            condition, arrow, action = part.partition("->")
            rules.append({"condition": condition.strip(), "action": action.strip()} if arrow else part)
        return rules


def _field(default: Any, help: str, check: Check) -> Any:
    """A dataclass field with help text and a value check (mutable defaults are copied per instance)."""
    metadata = {"help": help, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def to_plain(value: Any) -> Any:
    """A value as YAML/JSON-friendly data (enum -> its value, rule -> dict): the one conversion of the
    config's option enums to the plain strings the rest of the package reads. The enums stay on the config
    (``cfg.memory.optimization.value`` works); a function that takes a setting either as the config's enum or
    as a string (a level from the CLI) calls this once.

    Example:
        >>> to_plain(MemoryLevel.AGGRESSIVE), to_plain("balanced"), to_plain([DType.BF16, "fp32"]), to_plain(None)
        ('aggressive', 'balanced', ['bf16', 'fp32'], None)
    """
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, FallbackRule):
        return value.to_dict()
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


class _Section:
    """Shared behaviour of the config sections: checking, dict conversion, help."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.metadata["check"](f"{self.section}.{f.name}", getattr(self, f.name)))

    @classmethod
    def keys(cls) -> list[str]:
        """The field names of this section, in declaration order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def field_check(cls, name: str) -> Check:
        """The check of field ``name``."""
        return next(f.metadata["check"] for f in fields(cls) if f.name == name)

    @classmethod
    def check_keys(cls, data: Any) -> Mapping[str, Any]:
        """Return ``data`` (None -> {}) after checking it is a mapping of this section's keys.

        Raises:
            ConfigError: for a non-mapping or an unknown key (suggesting the closest valid key).
        """
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise invalid_value(cls.section, data, f"a mapping with keys {', '.join(cls.keys())}")
        for key in data:
            if key not in cls.keys():
                raise unknown_key(key, cls.keys(), prefix=cls.section)
        return data

    @classmethod
    def from_dict(cls, data: Any):
        """Build the section from a mapping; unknown keys raise ConfigError with a suggestion."""
        return cls(**cls.check_keys(data))

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data (strings for enums, dicts for rules)."""
        return {f.name: to_plain(getattr(self, f.name)) for f in fields(self)}


@dataclass
class GradientConfig(_Section):
    """The gradient pipeline of ``RapidFireOptimizer`` (per-parameter updates overlapping backward)."""

    section: ClassVar[str] = "gradient"

    pipeline: bool = _field(
        True, "Update each parameter as soon as its gradient is complete, overlapping backward.", Bool()
    )
    pipeline_depth: int = _field(
        4,
        "Most gradient buckets (of about bucket_mb each) the pipeline updates inside backward per optimizer "
        "step, ahead of verification; the other buckets are updated in step() once the step is verified "
        "(RapidFireOptimizer's pipeline_depth).",
        Int(min=1, max=MAX_PIPELINE_DEPTH),
    )
    overlap_factor: float = _field(
        0.5,
        "Share of the optimizer step that overlaps backward (0: none, 1: all of it): the gradient pipeline "
        "updates the buckets that start within this share of the gradient bytes, first buckets of "
        "backward first, as soon as their gradients are complete; the rest are updated in step() after "
        "verification. Only the overlapped buckets need a rollback snapshot, so the snapshot is about this "
        "share of the parameters and optimizer state (RapidFireOptimizer's pipeline_share).",
        Float(0.0, 1.0),
    )
    sync_interval: int = _field(
        1,
        "Optimizer steps verified together with one host read (1: every step). Above 1 each step is applied "
        "at once with its health flags kept on the device; every this many steps they are read (on CUDA "
        "without waiting: consumed at the next step) and a failure undoes the span from a snapshot taken at "
        "its start, PPOTrainer replaying its healthy mini-batches (RapidFireOptimizer's sync_interval; the "
        "trainers of enable_rapidfire, which cannot replay, verify every step). PPOTrainer verifies at the end "
        "of each update anyway, so it caps the span at one update's optimizer steps (num_ppo_epochs x "
        "num_mini_batches): with one step per update, that step is verified before it applies, without a snapshot.",
        Int(min=1, max=MAX_STEP_INTERVAL),
    )
    bucket_mb: float = _field(
        256.0,
        "MiB of gradient the pipeline updates at once: parameters are grouped, in the order their "
        "gradients complete, into buckets of about this size, each stepped with one optimizer call "
        "(0: each parameter on its own). Fewer, larger buckets mean fewer optimizer calls in backward: "
        "on an H200 (1.1B Llama, one micro-batch) 64 MiB ran at 1.06x fused AdamW's step time, 256 MiB "
        "at 0.99x.",
        Float(0.0, 65536.0),
    )
    clip_prediction: ClipPrediction = _field(
        ClipPrediction.EXACT,
        "Windows where max_grad_norm may bind: 'exact' (the default) steps them after backward with the "
        "exact clip coefficient (windows where clipping cannot bind stay pipelined); 'scale' steps them in "
        "the pipeline with the coefficient predicted from the last window, rolling back (PPO: replaying) a "
        "window whose prediction misses by more than clip_tolerance (rapidfire/clip_miss_rate), then "
        "stepping the next 1, 2, 4, ... windows exactly. 'exact' is the default because a miss costs a "
        "whole window again while the overlap gains at most one optimizer step: on one H200 (1.1B, rollout "
        "batch 256, fused value, one window per update) 'scale' missed every other window (benchmarks/presets). enable_rapidfire's trainers, which cannot replay a window, always use 'exact' "
        "(optimizer_kwargs={'clip_prediction': 'scale'} overrides it).",
        Choice(ClipPrediction),
    )
    clip_tolerance: float = _field(
        0.05,
        "Largest accepted relative difference between the predicted and the true clip coefficient "
        "(clip_prediction 'scale').",
        Float(0.001, 0.999),
    )


@dataclass
class MemoryConfig(_Section):
    """Memory compaction, telemetry and prefetching (``MemoryCompactionCallback``)."""

    section: ClassVar[str] = "memory"

    optimization: MemoryLevel = _field(
        MemoryLevel.BALANCED,
        "A target, not an order: how much of the device the run may plan to use and which trades it may make "
        "to fit what you asked (conservative: 80% of the device, smaller generation/scoring chunks only; "
        "balanced and auto: 85%, chunks and activation recompute; aggressive: 92%, the same trades). No level "
        "recomputes activations that fit (rapidfire_hf.memory.planner); it also sets how often compaction "
        "may run.",
        Choice(MemoryLevel),
    )
    checkpointing: Checkpointing = _field(
        Checkpointing.AUTO,
        "Selective activation checkpointing of the trained models' decoder layers. 'auto': none when the "
        "planned peak fits the level's target, else the least recompute that fits. Force it to keep memory "
        "free for something else: 'elementwise' (recompute element-wise ops, keep matmul and attention "
        "outputs), 'matmuls' (also recompute matmuls and attention cheaper than 4096 FLOPs per byte kept); "
        "'off' never recomputes. Not applied when gradient_checkpointing=True (HF's full checkpointing).",
        Choice(Checkpointing),
    )
    planner: bool = _field(
        True,
        "The throughput planner (PPOTrainer): from a measured one-row probe and the free memory it chooses "
        "how each mini-batch is split into micro-batches, the scoring chunk and the generation chunk to "
        "maximise tokens/s within the level's target; your explicit settings are kept. False keeps your "
        "per_device_train_batch_size split exactly, and 'auto' chunks take TRL's defaults.",
        Bool(),
    )
    compaction_threshold: float = _field(
        0.3,
        "Release cached blocks when fragmentation (1 - allocated/reserved) passes this value.",
        Float(0.0, 1.0, open_low=True),
    )
    release_after_rollout: RolloutRelease = _field(
        RolloutRelease.PRESSURE,
        "When the memory callback releases the allocator's cached blocks between rollout and training "
        "(PPOTrainer after scoring; enable_rapidfire's fast GRPO/RLOO rollout after generation): "
        "torch.cuda.empty_cache, the blocks then allocated again. 'pressure' (the default): only once the "
        "allocator holds 85% of the device, as threshold compactions are. 'always': every update, the "
        "default until 2026-12-04; on an H200 at PPO batch 8 (1.1B) it cost 12-16% of each update and "
        "lowered no peak (benchmarks/presets/results/h200/release8).",
        Choice(RolloutRelease),
    )
    prefetch_window: int = _field(
        2,
        "Batches prepared ahead of the one training: PPOTrainer's prompt batches, or the DataLoader batches "
        "of enable_rapidfire's trainers, are collated (and on CUDA copied to the device from pinned memory "
        "on a side stream) this many steps early; the order and contents do not change (0: no prefetch).",
        Int(min=0, max=MAX_PREFETCH),
    )
    lowmem: LowMem = _field(
        LowMem.OFF,
        "Low-memory stack for TRL's GRPOTrainer/RLOOTrainer, applied by enable_rapidfire (any other trainer: "
        "an error). 'off': nothing. 'on': decoder layers checkpointed in row chunks with their inputs in "
        "pooled pinned host memory (replaces HF gradient checkpointing), the rollout engine released after "
        "every rollout with its prefill in chunks and cuBLAS workspaces freed, TRL's LM-head tile 4096, "
        "bitsandbytes' per-parameter syncs skipped on the default stream, RapidFireOptimizer rollback 'off' "
        "unless optimizer_kwargs sets it. 'on_8bit_embedding': also the embedding's AdamW state in 8 bits "
        "(transformers keeps it 32-bit for optim='adamw_8bit'). The option does not change your math by "
        "itself: it requires max_grad_norm=0.0 (no clipping) and optim='adamw_8bit' (8-bit AdamW state; "
        "'on' also accepts an optimizer you pass) in the trainer's arguments and raises naming them "
        "otherwise. Same math otherwise up to rounding: per-chunk bf16 weight-gradient partials are summed "
        "in fp32. Measured (benchmarks/grpo, H200, 1.1B, 'on_8bit_embedding'): 3.9x stock TRL's steady-"
        "state tokens/s at 0.50x its peak memory.",
        Choice(LowMem),
    )


@dataclass
class PrecisionConfig(_Section):
    """Compute precision and the rules that change it during a run (``AdaptivePrecisionPlugin``)."""

    section: ClassVar[str] = "precision"

    mode: PrecisionMode = _field(
        PrecisionMode.ADAPTIVE,
        "'static': `initial` everywhere; 'adaptive': measure layer sensitivity and apply fallback rules.",
        Choice(PrecisionMode),
    )
    initial: DType = _field(DType.BF16, "Precision the run starts in.", Choice(DType))
    fallback: list[FallbackRule] = _field(
        [{"condition": "nonfinite_grads > 0", "action": "switch_to fp32"}],
        "Rules {condition, action} checked after each optimizer step, in order (see rapidfire_hf.config.rules).",
        RuleList(),
    )


@dataclass
class LoggingConfig(_Section):
    """What rapidfire_hf logs, how often, and where."""

    section: ClassVar[str] = "logging"

    level: LogLevel = _field(
        LogLevel.INFO,
        "Level of the rapidfire_hf Python logger, set by PPOTrainer and enable_rapidfire: records below "
        "it are dropped; the application's logging configuration shows the rest.",
        Choice(LogLevel),
    )
    log_every: int = _field(
        1,
        "Training steps (optimizer steps; PPO updates in PPOTrainer) between the logs that carry the "
        "rapidfire/* metrics: a trainer log (every logging_steps) includes them only when this many steps "
        "passed since they were last included (1: every log).",
        Int(min=1, max=MAX_STEP_INTERVAL),
    )
    report_to: list[str] = _field(
        [], "Experiment trackers to send metrics to (none by default).", StrList(REPORT_TARGETS)
    )
    wandb_project: str | None = _field(
        None, "W&B project name (null: the WANDB_PROJECT default).", OptionalStr()
    )
    telemetry_dir: str | None = _field(
        None,
        "Folder for the telemetry stream `rapidfire monitor` reads (null: <output_dir>/telemetry).",
        OptionalStr(),
    )


SECTIONS: dict[str, type[_Section]] = {
    "gradient": GradientConfig,
    "memory": MemoryConfig,
    "precision": PrecisionConfig,
    "logging": LoggingConfig,
}


@dataclass
class RapidFireConfig:
    """All rapidfire_hf settings. Defaults are the ``balanced`` preset.

    Sections may be given as section instances or as mappings (checked like ``from_dict``).

    Example:
        >>> cfg = RapidFireConfig(gradient={"pipeline_depth": 8})
        >>> cfg.gradient.pipeline_depth, cfg.memory.optimization.value
        (8, 'balanced')
    """

    gradient: GradientConfig = field(
        default_factory=GradientConfig, metadata={"help": GradientConfig.__doc__}
    )
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata={"help": MemoryConfig.__doc__})
    precision: PrecisionConfig = field(
        default_factory=PrecisionConfig, metadata={"help": PrecisionConfig.__doc__}
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": LoggingConfig.__doc__})

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                setattr(self, name, cls.from_dict(value))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RapidFireConfig:
        """Build from the full nested form (as ``config/advanced.yaml``); missing keys take defaults.

        Raises:
            ConfigError: for an unknown key (with the closest valid one), a wrong type or range, or a bad rule.
        """
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise invalid_value("<config>", data, f"a mapping with keys {', '.join(SECTIONS)}")
        for key in data:
            if key not in SECTIONS:
                raise unknown_key(key, SECTIONS)
        return cls(**{name: SECTIONS[name].from_dict(data.get(name)) for name in SECTIONS})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The full nested form as plain data; ``RapidFireConfig.from_dict(cfg.to_dict()) == cfg``."""
        return {name: getattr(self, name).to_dict() for name in SECTIONS}

    def to_yaml(self) -> str:
        """The full nested form as YAML text."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def copy(self) -> RapidFireConfig:
        """An independent, re-validated copy."""
        return RapidFireConfig.from_dict(self.to_dict())
