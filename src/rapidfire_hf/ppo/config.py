"""PPOConfig: TRL 1.12's PPO arguments on top of ``transformers.TrainingArguments``, plus rapidfire options."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import TrainingArguments

from rapidfire_hf.config.checks import Among, AutoOr, Bool, Check, Float, FloatList, Int, Optional, Str
from rapidfire_hf.config.contract import (
    APPLIED,
    CONTRACT_KEY,
    SWEEP_ONE_PROCESS,
    Use,
    applied,
    both,
    na,
    refused,
    row,
)
from rapidfire_hf.config.errors import ConfigError, ConfigErrors
from rapidfire_hf.memory.offload_plan import HOST_OFFLOAD_DEFAULT

_POSITIVE = Float(0.0, math.inf, open_low=True)
_NON_NEGATIVE = Float(0.0, math.inf)
# "auto": 8 or 4 bits where the plan pays for it, under memory.optimization=aggressive only (memory.frozen_choice)
_QUANTIZATION = Optional(Among(("8bit", "4bit", "auto")), "kept as given")
# rollout_kv_cache_dtype: "auto" and "model" keep the model's dtype (None to the engine); "fp8" / "int8" are
# RolloutEngine's kv_cache_dtype (kernels/kv_quant.py)
KV_CACHE_CHOICES = ("auto", "model", "fp8", "int8")
KV_CACHE_DEFAULT = "auto"  # int8 where aggressive's plan generates in fewer chunks with it (memory.kv_choice)


def engine_kv_cache_dtype(value: str) -> str | None:
    """``RolloutEngine``'s ``kv_cache_dtype`` for ``PPOConfig.rollout_kv_cache_dtype`` before any plan: None
    for ``"auto"`` and ``"model"``, else the value. What ``"auto"`` runs is the plan's
    (``Plan.engine_kv_cache_dtype``: :mod:`rapidfire_hf.memory.kv_choice`)."""
    return None if value in ("auto", "model") else value


@dataclass(frozen=True)
class _StepCount(Check):
    """``max_steps``: -1 (not set: the count follows total_episodes) or an integer >= 1."""

    allowed = "-1 (not set: total_episodes decides) or an integer >= 1"

    def __call__(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            self.fail(key, value)
        return value


# What each numeric, boolean and option field of PPOConfig accepts, checked before training. The
# TrainingArguments fields listed are the ones PPOTrainer reads; transformers checks its others.
FIELD_CHECKS: dict[str, Check] = {
    "per_device_train_batch_size": Int(min=1),
    "gradient_accumulation_steps": Int(min=1),
    "learning_rate": _NON_NEGATIVE,
    "weight_decay": _NON_NEGATIVE,
    "adam_beta1": Float(0.0, 1.0, open_high=True),
    "adam_beta2": Float(0.0, 1.0, open_high=True),
    "adam_epsilon": _POSITIVE,  # 0 divides 0 by 0 for a parameter that never had a gradient
    "max_grad_norm": Optional(_NON_NEGATIVE, "no clipping, as 0"),
    "num_train_epochs": _POSITIVE,
    "max_steps": _StepCount(),
    "seed": Int(min=0, max=2**32 - 1),  # numpy's seed range (transformers.set_seed seeds numpy)
    "num_mini_batches": Int(min=1),
    "total_episodes": Optional(Int(min=1), "num_train_epochs * len(train_dataset)"),
    "local_rollout_forward_batch_size": AutoOr(Int(min=1)),
    "response_length": Int(min=1),
    "stop_token": Optional(Among(("eos",)), "no stop token; use stop_token_id for other tokens"),
    "stop_token_id": Optional(Int(min=0), "no stop token"),
    "temperature": _POSITIVE,
    "top_k": Int(min=0),
    "top_p": Float(0.0, 1.0, open_low=True),
    "missing_eos_penalty": Optional(_NON_NEGATIVE, "no penalty"),
    "num_ppo_epochs": Int(min=1),
    "whiten_rewards": Bool(),
    "kl_coef": _NON_NEGATIVE,
    "kl_estimator": Among(("k1", "k3")),
    "cliprange": _POSITIVE,
    "vf_coef": _NON_NEGATIVE,
    "cliprange_value": _POSITIVE,
    "gamma": Float(0.0, 1.0),
    "lam": Float(0.0, 1.0),
    "reward_weights": Optional(FloatList(), "1.0 for every reward function"),
    "max_prompt_length": Optional(Int(min=1), "no truncation"),
    "dataset_text_field": Str(),
    "num_sample_generations": Int(min=0),
    "dataset_num_proc": Optional(Int(min=1), "tokenize in this process"),
    "sft_model_path": Optional(Str(), "not given"),
    "reward_model_path": Optional(Str(), "not given"),
    "model_adapter_name": Optional(Str(), "the PEFT model's active adapter"),
    "ref_adapter_name": Optional(Str(), "the adapter-disabled base is the reference"),
    "ds3_gather_for_generation": Bool(),
    "exp_name": Str(),
    "memory_management": Bool(),
    "max_oom_splits": Int(min=0, max=64),  # 64 halvings split any batch down to single rows
    "approx_kl_limit": Optional(_POSITIVE, "no approx-KL rule"),
    "max_consecutive_skips": Optional(Int(min=1), "never stop on skipped steps"),
    "value_mode": Among(("separate", "fused")),
    "ref_model_quantization": _QUANTIZATION,
    "reward_model_quantization": _QUANTIZATION,
    "rollout_backend": Among(("auto", "static", "hf")),
    "rollout_decode_mode": Among(("auto", "compile", "cuda_graph", "eager")),
    "rollout_decode_attention": Among(("auto", "sdpa", "matmul", "triton")),
    "rollout_decode_sampler": Among(("torch", "triton", "triton-philox")),
    "rollout_decode_fuse_projections": AutoOr(Bool()),
    "rollout_decode_linear": Among(("torch", "triton")),
    "rollout_decode_fuse_lora": Bool(),
    "rollout_cache": Among(("keep", "auto")),
    "rollout_kv_cache_dtype": Among(KV_CACHE_CHOICES),
    "host_offload": Among(("auto", "on", "off")),
    "rollout_generation_batch_size": AutoOr(Optional(Int(min=1), "the whole rollout batch at once")),
}


def check_value_mode(args: PPOConfig, value_model: Any) -> None:
    """Refuse ``value_mode="fused"`` together with a separate ``value_model`` (one of them would be ignored).

    Raises:
        ConfigError: naming ``value_mode`` and the two ways out.
    """
    if args.value_mode == "fused" and value_model is not None:
        raise ConfigError(
            f"a value_model ({type(value_model).__name__}) was passed too, and the fused mode has no use for "
            "it: drop value_model to train a value head on the policy, or set value_mode='separate' to train "
            "the value model",
            key="value_mode",
            value=args.value_mode,
            allowed="'separate' with a value_model, or 'fused' with value_model=None",
        )


def check_optimizer_options(args: PPOConfig, rapidfire_optimizer: bool) -> None:
    """Refuse options that only a ``RapidFireOptimizer`` applies when another optimizer is used.

    Raises:
        ConfigError: ``approx_kl_limit`` is set but the optimizer cannot roll a step back.
    """
    if args.approx_kl_limit is not None and not rapidfire_optimizer:
        raise ConfigError(
            "needs a RapidFireOptimizer to roll back a step whose approx-KL passes the limit, and the "
            "optimizer is not one: pass optimizer=RapidFireOptimizer(...) or rapidfire_config=..., or drop "
            "approx_kl_limit",
            key="approx_kl_limit",
            value=args.approx_kl_limit,
            allowed="None with any optimizer, or a finite number > 0 with a RapidFireOptimizer",
        )


def check_fields(obj: Any, checks: Mapping[str, Check]) -> list[ConfigError]:
    """The errors of ``obj``'s attributes against ``checks`` (every field is checked; none is changed)."""
    errors = []
    for name, check in checks.items():
        try:
            check(name, getattr(obj, name))
        except ConfigError as err:
            errors.append(err)
    return errors


def _is_bool_type(annotation: Any) -> tuple[bool, bool]:
    """``(is a bool field, may be None)`` from a dataclass field's annotation (a type or its text)."""
    text = str(annotation).replace("<class 'bool'>", "bool").replace(" ", "")
    parts = set(text.replace("Optional[", "").rstrip("]").split("|"))
    return parts in ({"bool"}, {"bool", "None"}), "None" in parts


def bool_field_errors(obj: Any) -> list[ConfigError]:
    """Refuse a non-bool in a bool field (``bf16=1`` or ``"yes"`` would pass as true): every dataclass field
    annotated ``bool`` (or ``bool | None``) of ``obj``."""
    errors = []
    for f in fields(obj):
        # the class's annotation, not f.type: HfArgumentParser rewrites f.type in place (str | bool -> bool)
        annotation = next((c.__annotations__[f.name] for c in type(obj).__mro__
                           if f.name in getattr(c, "__annotations__", {})), f.type)  # fmt: skip
        is_bool, optional = _is_bool_type(annotation)
        value = getattr(obj, f.name, None)
        if f.name in FIELD_CHECKS:  # checked there
            continue
        if is_bool and not isinstance(value, bool) and not (optional and value is None):
            errors.append(
                ConfigError("must be True or False", key=f.name, value=value,
                            allowed="True or False" + (" or None" if optional else ""))
            )  # fmt: skip
    return errors


# ------------------------------------------------------------------------------------ each field's facts
@dataclass(frozen=True)
class FieldFacts:
    """What one PPOConfig field is to the rest of the library, declared with the field (``facts(...)`` in its
    metadata). :mod:`rapidfire_hf.ppo.field_facts` derives the per-field tables from these: the settings a
    resume compares, the fields a sweep trial may set, the model card's rows and the settings contract."""

    contract: Mapping[str, Use] | None = None  # its settings-contract row: what each entry point does with it
    resume: str | None = None  # what another value changes: a resume with another value is refused, saying so
    optimizer_state: bool = False  # a restored optimizer carries it: on resume the checkpoint's value is kept
    sweep: bool = False  # a sweep trial may set it (the kind of value: its annotation)
    card: int | None = None  # its row in the model card (1 is the first)


FACTS_KEY = "facts"


class FieldMetadata(Mapping[str, Any]):
    """A PPOConfig field's ``metadata``: ``{"help": ...}``, its :class:`FieldFacts` under ``FACTS_KEY`` and its
    settings-contract row under ``CONTRACT_KEY`` (read by :func:`rapidfire_hf.config.contract.field_rows`),
    these two read by key only: HfArgumentParser hands every key it iterates to argparse, which takes ``help``."""

    def __init__(self, help: str, field_facts: FieldFacts):
        self._items = {"help": help}
        self.facts = field_facts

    def __getitem__(self, key: str) -> Any:
        if key == FACTS_KEY:
            return self.facts
        if key == CONTRACT_KEY:
            return self.facts.contract
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def facts(help: str, **kw: Any) -> FieldMetadata:
    """A field's metadata: its ``help`` and its :class:`FieldFacts` (``kw``: FieldFacts' fields)."""
    return FieldMetadata(help, FieldFacts(**kw))


def declared_facts(f: Any) -> FieldFacts | None:
    """The facts a dataclass field of PPOConfig declares, or None (a field it inherits)."""
    found = f.metadata.get(FACTS_KEY)
    return found if isinstance(found, FieldFacts) else None


# The facts of TrainingArguments fields PPOConfig inherits without declaring them again (their settings-contract
# rows: rapidfire_hf.config.contract.TRAINING_ARGS_ROWS).
INHERITED_FACTS: dict[str, FieldFacts] = {
    "per_device_train_batch_size": FieldFacts(sweep=True, card=11),
    "gradient_accumulation_steps": FieldFacts(sweep=True, card=12),
    "seed": FieldFacts(sweep=True, card=16),
    "weight_decay": FieldFacts(optimizer_state=True, sweep=True),
    "adam_beta1": FieldFacts(optimizer_state=True, sweep=True),
    "adam_beta2": FieldFacts(optimizer_state=True, sweep=True),
    "adam_epsilon": FieldFacts(optimizer_state=True, sweep=True),
    "max_grad_norm": FieldFacts(sweep=True),
    "lr_scheduler_type": FieldFacts(sweep=True),
    "lr_scheduler_kwargs": FieldFacts(sweep=True),
    "warmup_steps": FieldFacts(sweep=True),
    "max_steps": FieldFacts(sweep=True),
    "num_train_epochs": FieldFacts(sweep=True),
}


@dataclass
class PPOConfig(TrainingArguments):
    """Arguments of :class:`rapidfire_hf.PPOTrainer`.

    The PPO fields and their defaults are those of TRL 1.12's ``trl.experimental.ppo.PPOConfig`` so a
    TRL script moves over unchanged. Batch sizes per device follow TRL: one rollout batch holds
    ``per_device_train_batch_size * gradient_accumulation_steps`` prompts; it is split into
    ``num_mini_batches`` mini-batches (one optimizer step each) of micro-batches of
    ``per_device_train_batch_size``. Unlike TRL, ``max_grad_norm`` clips gradients (set 0 to turn it
    off), accumulation is aligned to mini-batches, and ``gradient_checkpointing`` defaults to off.

    Two ``TrainingArguments`` switches speed up scoring and training (not the rollout, which runs its own
    decode step): ``use_liger_kernel`` (with ``liger_kernel_config``) puts Liger's Triton kernels (RMSNorm,
    SwiGLU, RoPE; never the fused cross-entropy) into the policy, value and reference models, on CUDA;
    ``torch_compile`` (with ``torch_compile_backend`` / ``torch_compile_mode``) compiles each of their
    decoder layers. See :mod:`rapidfire_hf.ppo.speedups`.

    Example:
        >>> args = PPOConfig(output_dir="out", per_device_train_batch_size=8, response_length=64,
        ...                  total_episodes=10_000, rapidfire_config="config/advanced.yaml")
    """

    # Defaults that differ from TrainingArguments (as in TRL 1.12).
    learning_rate: float = field(
        default=3e-6,
        metadata=facts(
            "Initial learning rate of AdamW.",
            contract=both(APPLIED),
            optimizer_state=True,
            sweep=True,
            card=1,
        ),
    )
    logging_steps: float = field(
        default=1,
        metadata=facts(
            "Log every N PPO updates (1, the default, logs every update as TRL 1.12 does).",
            contract=both(APPLIED),
            sweep=True,
        ),
    )
    save_strategy: str = field(
        default="no",
        metadata=facts(
            "'no' or 'steps' (every save_steps updates).",
            contract=row(
                refused(
                    "PPOTrainer saves every save_steps updates ('steps') or not at all ('no')",
                    ("no", "steps"),
                ),
                refused("a sweep saves every save_steps updates ('steps') and at the end", ("no", "steps")),
            ),
        ),
    )

    # PPO (TRL 1.12 names and defaults).
    num_mini_batches: int = field(
        default=1,
        metadata=facts(
            "Mini-batches per rollout batch (optimizer steps per epoch).",
            contract=both(APPLIED),
            sweep=True,
            card=10,
        ),
    )
    total_episodes: int | None = field(
        default=None,
        metadata=facts(
            "Prompts to train on in total (default: num_train_epochs * len(train_dataset)).",
            contract=both(APPLIED),
            sweep=True,
        ),
    )
    # annotated `str` so that HfArgumentParser takes "auto" from a command line (digits become an int below)
    local_rollout_forward_batch_size: str = field(
        default="auto",
        metadata=facts(
            "Rows per no-grad forward in the scoring phase (per device). 'auto': the throughput planner "
            "chooses the largest chunk that fits (memory.planner; TRL's 64 without a rapidfire config).",
            contract=both(APPLIED),
        ),
    )
    response_length: int = field(
        default=53,
        metadata=facts(
            "Maximum number of generated response tokens.",
            contract=both(APPLIED),
            resume="every rollout's length, hence the tokens trained on",
            card=13,
        ),
    )
    stop_token: str | None = field(
        default=None,
        metadata=facts(
            "'eos' to stop at the tokenizer's EOS, or None.",
            contract=both(APPLIED),
            resume="where responses end",
        ),
    )
    stop_token_id: int | None = field(
        default=None,
        metadata=facts(
            "Token id that ends a response (exclusive with stop_token).",
            contract=both(APPLIED),
            resume="where responses end",
        ),
    )
    temperature: float = field(
        default=0.7,
        metadata=facts(
            "Sampling temperature.",
            contract=both(APPLIED),
            resume="the sampling distribution of every rollout",
            card=14,
        ),
    )
    top_k: int = field(
        default=0,
        metadata=facts(
            "Top-k sampling filter (0 = off).",
            contract=both(APPLIED),
            resume="the sampling distribution of every rollout",
        ),
    )
    top_p: float = field(
        default=1.0,
        metadata=facts(
            "Nucleus sampling filter (1.0 = off).",
            contract=both(APPLIED),
            resume="the sampling distribution of every rollout",
        ),
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata=facts(
            "Subtracted from the score of responses that contain no EOS (positive).",
            contract=both(APPLIED),
            resume="the rewards",
            sweep=True,
        ),
    )
    num_ppo_epochs: int = field(
        default=4,
        metadata=facts(
            "PPO epochs over each rollout batch.",
            contract=both(APPLIED),
            resume="the optimizer steps of every update",
            sweep=True,
            card=9,
        ),
    )
    whiten_rewards: bool = field(
        default=False,
        metadata=facts(
            "Whiten the shaped rewards.", contract=both(APPLIED), resume="the advantages", sweep=True
        ),
    )
    kl_coef: float = field(
        default=0.05,
        metadata=facts(
            "KL penalty coefficient.",
            contract=both(APPLIED),
            resume="the KL-shaped rewards",
            sweep=True,
            card=2,
        ),
    )
    kl_estimator: str = field(
        default="k1",
        metadata=facts(
            "KL estimator for the reward penalty: 'k1' or 'k3'.",
            contract=both(APPLIED),
            resume="the KL-shaped rewards",
            sweep=True,
            card=3,
        ),
    )
    cliprange: float = field(
        default=0.2,
        metadata=facts(
            "Policy ratio clip range.", contract=both(APPLIED), resume="the policy loss", sweep=True, card=4
        ),
    )
    vf_coef: float = field(
        default=0.1,
        metadata=facts(
            "Value loss coefficient.", contract=both(APPLIED), resume="the loss", sweep=True, card=6
        ),
    )
    cliprange_value: float = field(
        default=0.2,
        metadata=facts(
            "Value prediction clip range.",
            contract=both(APPLIED),
            resume="the value loss",
            sweep=True,
            card=5,
        ),
    )
    gamma: float = field(
        default=1.0,
        metadata=facts(
            "Discount factor.", contract=both(APPLIED), resume="the advantages", sweep=True, card=7
        ),
    )
    lam: float = field(
        default=0.95,
        metadata=facts("GAE lambda.", contract=both(APPLIED), resume="the advantages", sweep=True, card=8),
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata=facts(
            "Weights of the reward functions (default: all 1.0).",
            contract=both(APPLIED),
            resume="the rewards",
            sweep=True,
        ),
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata=facts(
            "Truncate prompts (left) to this many tokens.",
            contract=both(APPLIED),
            resume="how prompts are cut",
        ),
    )
    dataset_text_field: str = field(
        default="prompt", metadata=facts("Column holding the prompt text.", contract=both(APPLIED))
    )
    num_sample_generations: int = field(
        default=10,
        metadata=facts(
            "Show and log (W&B, TensorBoard) a table of prompts, completions and scores this many times "
            "during training (generate_completions on the eval prompts, else the current rollout; 0 = never).",
            contract=row(APPLIED, refused("a sweep writes no sample tables", (0, 10))),
        ),
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata=facts(
            "Processes that tokenize the prompt datasets (datasets' map num_proc); None: this one.",
            contract=row(APPLIED, refused("a sweep tokenizes its prompts in this process")),
        ),
    )
    sft_model_path: str | None = field(
        default=None,
        metadata=facts(
            "Path of the SFT policy for scripts such as examples/ppo.py; PPOTrainer takes the model.",
            contract=both(na("read by scripts such as examples/ppo.py; the entry points take the model")),
        ),
    )
    reward_model_path: str | None = field(
        default=None,
        metadata=facts(
            "Path of the reward model for scripts such as examples/ppo.py; PPOTrainer takes the model.",
            contract=both(na("read by scripts such as examples/ppo.py; the entry points take the model")),
        ),
    )
    model_adapter_name: str | None = field(
        default=None,
        metadata=facts(
            "With a PeftModel holding several adapters: the adapter to train (made active at "
            "construction, and again after each reference pass). None keeps the model's active adapter.",
            contract=row(
                APPLIED,
                refused("each trial trains its own adapter on the shared base, whose reference is the base"),
            ),
        ),
    )
    ref_adapter_name: str | None = field(
        default=None,
        metadata=facts(
            "With a PeftModel holding several adapters: the adapter whose policy is the frozen "
            "reference (active during the reference pass). None: the adapter-disabled base is the reference.",
            contract=row(
                APPLIED,
                refused("each trial trains its own adapter on the shared base, whose reference is the base"),
            ),
        ),
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata=facts(
            "DeepSpeed ZeRO-3: gather the policy's weights for generation (the rollout engine needs "
            "them whole). False, generation from sharded weights, is refused under ZeRO-3; other engines "
            "ignore the key, as TRL does.",
            contract=row(APPLIED, refused(SWEEP_ONE_PROCESS)),
        ),
    )
    exp_name: str = field(
        default="ppo",
        metadata=facts(
            "Experiment name: run_name defaults to '<exp_name>__<seed>__<unix time>' as in TRL.",
            contract=row(
                applied("names run_name"), na("names run_name only, which a sweep replaces by trial names")
            ),
        ),
    )

    # rapidfire_hf.
    memory_management: bool = field(
        default=True,
        metadata=facts(
            "Attach MemoryCompactionCallback (allocator setup, phase-boundary compaction, telemetry).",
            contract=row(APPLIED, na("a sweep attaches no memory callback either way")),
        ),
    )
    max_oom_splits: int = field(
        default=3,
        metadata=facts(
            "On CUDA OOM in a micro-batch, halve it and retry up to this many times (0 = never).",
            contract=both(APPLIED),
        ),
    )
    approx_kl_limit: float | None = field(
        default=None,
        metadata=facts(
            "With a RapidFireOptimizer: roll back an optimizer step whose approx-KL exceeds this.",
            contract=row(
                applied("a RapidFireOptimizer rule; refused by name with another optimizer"),
                refused("sweep trials train with torch AdamW, which cannot roll a step back"),
            ),
        ),
    )
    max_consecutive_skips: int | None = field(
        default=10,
        metadata=facts(
            "Optimizer steps skipped in a row (NaN/inf loss or gradients, failed health rules) after "
            "which training stops with an error naming what failed (None = never stop). Every skipped step "
            "is logged as a warning and counted in rapidfire/skipped_steps.",
            contract=both(APPLIED),
        ),
    )
    value_mode: str = field(
        default="separate",
        metadata=facts(
            "'separate': a value model beside the policy (TRL parity). 'fused': a value head on the "
            "policy's last hidden state, so one forward gives log-probs and values. The fused trunk's "
            "optimizer step follows the sum of the policy and value gradients, so the policy moves less "
            "per step at the same learning rate: on the learning benchmark the fused head's best rate "
            "was about 3x the separate mode's (1e-3 against 3e-4; benchmarks/ppo_vs_trl).",
            contract=row(
                APPLIED,
                refused(
                    "every sweep trial trains a fused value head on the shared base (a separate value model per trial "
                    "is not implemented): set value_mode='fused' or leave it out",
                    ("fused",),
                ),
            ),
            card=15,
        ),
    )
    ref_model_quantization: str | None = field(
        default=None,
        metadata=facts(
            "Hold the frozen reference policy in '8bit' or '4bit' (bitsandbytes NF4); None keeps it as "
            "given. Not with LoRA (the reference is then the adapter-disabled policy itself). 'auto': 8 bits, "
            "else 4, only under memory.optimization=aggressive and only where the plan as given does not fit "
            "or makes a trade the quantized plan avoids (said in the plan table); else as given.",
            contract=row(
                applied(
                    "refused by name with LoRA (the reference is the adapter-disabled policy); 'auto' quantizes only "
                    "under aggressive where the plan pays, said in the plan table and the start table"
                ),
                refused(
                    "the sweep's reference is the shared base with adapters off; quantize the base when loading it"
                ),
            ),
        ),
    )
    reward_model_quantization: str | None = field(
        default=None,
        metadata=facts(
            "Hold the frozen reward model in '8bit' or '4bit' (bitsandbytes); None keeps it. 'auto': "
            "as ref_model_quantization's.",
            contract=row(
                applied("'auto' as ref_model_quantization's"),
                refused(
                    "a sweep scores with the reward model as given ('auto' too: the sweep has no frozen-model plan)"
                ),
            ),
        ),
    )
    rollout_backend: str = field(
        default="auto",
        metadata=facts(
            "'auto' (fast engine on GPU, model.generate elsewhere), 'static' or 'hf'.",
            contract=both(applied("'static' is refused by name for a model the static engine cannot run")),
        ),
    )
    rollout_decode_mode: str = field(
        default="auto",
        metadata=facts(
            "Decode step of the fast engine: 'auto' (torch.compile + CUDA graph on GPU for the first "
            "four batch shapes, then CUDA graph alone), 'compile', 'cuda_graph' or 'eager'.",
            contract=both(APPLIED),
        ),
    )
    rollout_decode_attention: str = field(
        default="auto",
        metadata=facts(
            "Decode attention of the fast engine: 'auto' (the default: 'triton' on CUDA GPUs where "
            "Triton runs, else 'sdpa'), 'sdpa' (fused GQA attention), 'matmul', or 'triton' (the project's "
            "flash-decoding kernel, which reads no cache slot past the current step's; one H200, same calls: "
            "decode step 1.24x at 7B batch 256, PPO updates 1.05x at 7B full batch 256, 1.06x at 7B LoRA "
            "batch 256, 1.02x / 1.00x at 1.1B batch 8 / 32: benchmarks/kernels).",
            contract=row(APPLIED, applied("'auto' runs SDPA in a sweep (said in the sweep's start line)")),
        ),
    )
    rollout_decode_sampler: str = field(
        default="torch",
        metadata=facts(
            "Sampling of the fast engine: 'torch', 'triton' (one fused kernel on the same noise: the "
            "same tokens; 3x faster at batch 256, 0.8x at 8) or 'triton-philox' (draws its own noise). The "
            "Triton samplers take temperature only (no top_k / top_p). Opt-in.",
            contract=both(APPLIED),
        ),
    )
    # annotated `str` so that HfArgumentParser takes "auto" from a command line ("true" / "false": below)
    rollout_decode_fuse_projections: str = field(
        default="auto",
        metadata=facts(
            "Decode step of the fast engine: one matmul for each layer's q/k/v projections and one for "
            "gate/up, from concatenated copies of their weights (refreshed before each rollout; PEFT, "
            "quantized or biased layers keep their modules). Costs a copy of those weights (1.2 GB at 1.1B, "
            "~9 GB at 7B). 'auto' (the default) holds the copies where the decode step is recorded on a CUDA "
            "GPU and they cost nothing else: with a rapidfire config, where the plan with them held makes the "
            "same choices and fits; without one, where they are at most 2% of the device. One H200, against "
            "the module projections in the same call: PPO updates at 1.1B 1.09x at batch 8 and 1.00x at batch 32 "
            "(benchmarks/kernels, calls 8 and 9; 1.14x and 1.09x with a faster training phase in call 6).",
            contract=row(APPLIED, applied("'auto' is off in a sweep; True fuses")),
        ),
    )
    rollout_decode_linear: str = field(
        default="torch",
        metadata=facts(
            "Decode step of the fast engine: the fused projections' matmul, 'torch' (F.linear) or "
            "'triton' (the project's skinny matmul for few rows; needs rollout_decode_fuse_projections=True). "
            "Opt-in: on one H200 it lost to F.linear (1.1B decode step 1.646 vs 1.492 ms at batch 8, 2.139 vs "
            "1.819 at 64; benchmarks/kernels).",
            contract=both(APPLIED),
        ),
    )
    rollout_decode_fuse_lora: bool = field(
        default=False,
        metadata=facts(
            "Decode step of the fast engine, with fused projections (rollout_decode_fuse_projections): "
            "fuse the layers whose projections carry a PEFT LoRA adapter too. The base weights are "
            "concatenated as for full fine-tuning; the adapter adds one matmul by the stacked A factors and "
            "one by the block-diagonal B * scaling per group (three matmuls for q/k/v where the adapter's "
            "modules make nine). Generations whose adapter state it does not reproduce (several active "
            "adapters, DoRA, dropout in training mode) keep the modules. Opt-in: not yet measured on a GPU.",
            contract=row(
                APPLIED,
                refused(
                    "the trials' adapters sit on the projections the sweep's decode would fuse; not implemented"
                ),
            ),
        ),
    )
    rollout_generation_batch_size: str | None = field(  # "auto", an int (digits: below) or None
        default="auto",
        metadata=facts(
            "Prompts generated at once (per device); None generates the whole rollout batch together. "
            "The rollout engine's KV cache grows with this (about 11.5 MB per sequence for a 1.1B Llama at "
            "512 tokens). 'auto': the throughput planner bounds it to fit (the whole batch without a rapidfire "
            "config).",
            contract=row(
                APPLIED,
                refused(
                    "the sweep decodes every trial's prompts in one call of the rollout engine",
                    ("auto", None),
                ),
            ),
        ),
    )
    rollout_cache: str = field(
        default="auto",
        metadata=facts(
            "The fast engine's KV cache between updates. 'auto' (the default; acts with a rapidfire "
            "config, whose planner decides): freed after each generation only where keeping it beside scoring "
            "and training would split generation into more chunks (the cache is then allocated and the decode "
            "graphs recorded again every update), kept otherwise. 'keep': always kept (allocated once, graphs "
            "recorded once), the generation chunk shrunk to fit beside training. At 7B full fine-tuning, batch "
            "160, 'aggressive': 4,147 against 3,824 tokens/s, stock TRL 222 (same call, "
            "benchmarks/presets/results/h200/full7b_freecache_stock).",
            contract=row(APPLIED, refused("a sweep keeps its engine's cache between updates", ("auto",))),
        ),
    )
    rollout_kv_cache_dtype: str = field(
        default=KV_CACHE_DEFAULT,
        metadata=facts(
            "The fast engine's KV cache: 'model' (the model's dtype), 'fp8' (e4m3) or 'int8': one byte "
            "per element plus one fp32 scale per (row, K/V head, token), 0.516x the bytes of bf16 at head "
            "width 128, so the plan's generation chunks grow (changes the arithmetic: greedy tokens may differ "
            "from the model dtype's cache). 'auto' (the default) is 'int8' where memory.optimization="
            "aggressive's plan then generates the rollout batch in fewer chunks (PPOTrainer; one H100, 7B LoRA "
            "batch 256: one chunk of 256 instead of 2 of 128, 4,084 vs 3,719 tokens/s in one call, "
            "benchmarks/card80/results/h100_2026-12-07c), else 'model'. 8-bit needs the static "
            "engine's native decode path: refused by name at start where the rollout runs model.generate "
            "(rollout_backend='hf', 'auto' on the CPU, ZeRO-3) or the generic path, and 'fp8' on a GPU below "
            "compute capability 8.9 (Triton compiles no e4m3 there). Said in the plan and start tables.",
            contract=both(
                applied(
                    "'fp8' / 'int8' by the static engine's native decode path, in the plan's KV-cache bytes and "
                    "its table; 'auto' by PPOTrainer's plan (memory.kv_choice) and as the model's dtype by "
                    "PPOSweep, each said in its plan table; refused by name where the rollout runs model.generate "
                    "or the generic path"
                )
            ),
        ),
    )
    host_offload: str = field(
        default=HOST_OFFLOAD_DEFAULT,
        metadata=facts(
            "Host memory between the phases of an update: the reference and reward models' weights "
            "kept in pinned host memory outside scoring (copied in on a side stream before it), the optimizer "
            "state outside training (copied out before generation, back before training). Exact: the "
            "arithmetic is unchanged; the copies cost time every update. 'auto' (the default; acts with a "
            "rapidfire config, whose planner decides): only where the room it frees changes the plan (bigger "
            "chunks or micro-batches, less recompute) and memory.optimization allows it (not 'conservative'); "
            "said in the plan table. At 7B full fine-tuning, batch 160, 'aggressive', one H100 80 GB: 3,857 "
            "against 2,559 tokens/s with 'off', 0 OOM splits each (same call, "
            "benchmarks/card80/results/h100_2026-12-06). 'on': always (whatever can move). 'off': never.",
            contract=row(
                applied("'auto' acts through the plan (a rapidfire config); 'on' also without one"),
                refused(
                    "a sweep keeps its base, reward model and optimizer state on the device", ("auto", "off")
                ),
            ),
        ),
    )
    rapidfire_config: Any = field(
        default=None,
        metadata=facts(
            "A rapidfire config: YAML path, preset name, dict (short or nested form) or RapidFireConfig.",
            contract=row(
                APPLIED,
                applied(
                    "memory.optimization, memory.planner and logging.level; other fields refused by name"
                ),
                applied("its config replaces the PPOTrainer's rapidfire_config"),
            ),
        ),
    )

    def __post_init__(self):
        for name in ("local_rollout_forward_batch_size", "rollout_generation_batch_size"):
            value = getattr(self, name)  # a command line gives text: "16" -> 16, "none" -> None
            if isinstance(value, str) and value.strip().isdigit():
                setattr(self, name, int(value))
            elif isinstance(value, str) and value.strip().lower() == "none" and name.startswith("rollout_"):
                setattr(self, name, None)
        fuse = self.rollout_decode_fuse_projections  # a command line gives text: "true" -> True
        if isinstance(fuse, str) and fuse.strip().lower() in ("true", "false"):
            self.rollout_decode_fuse_projections = fuse.strip().lower() == "true"
        # the table first: TrainingArguments' own checks would otherwise meet a bad value raw
        errors = bool_field_errors(self) + check_fields(self, FIELD_CHECKS)
        if errors:
            raise ConfigErrors("Invalid PPOConfig:", errors)
        if self.run_name is None:  # the trackers' run name (W&B, TensorBoard), as TRL names PPO runs
            self.run_name = f"{self.exp_name}__{self.seed}__{int(time.time())}"
        super().__post_init__()
        errors = self._cross_field_errors()
        if errors:
            raise ConfigErrors("Invalid PPOConfig:", errors)

    def _cross_field_errors(self) -> list[ConfigError]:
        """Problems of several fields together (each field alone is already valid)."""
        errors = []
        if self.stop_token is not None and self.stop_token_id is not None:
            errors.append(ConfigError("stop_token and stop_token_id are both set: set only one"))
        if self.local_batch_size % self.num_mini_batches:
            errors.append(
                ConfigError(
                    "per_device_train_batch_size * gradient_accumulation_steps = "
                    f"{self.local_batch_size} is not divisible by num_mini_batches={self.num_mini_batches}"
                )
            )
        if self.rollout_decode_linear != "torch" and self.rollout_decode_fuse_projections is not True:
            errors.append(
                ConfigError(
                    f"rollout_decode_linear={self.rollout_decode_linear!r} runs the fused decode projections "
                    "only: also set rollout_decode_fuse_projections=True"
                )
            )
        if self.rollout_decode_fuse_lora is True and self.rollout_decode_fuse_projections is False:
            errors.append(
                ConfigError(
                    "rollout_decode_fuse_lora=True fuses LoRA layers into the fused decode projections, which "
                    "rollout_decode_fuse_projections=False turns off: set it to True or 'auto'"
                )
            )
        return errors

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        changed = self.__dict__.get("_changed_fields")
        if changed is not None and name in _FIELD_NAMES:  # after construction: re-checked by validate()
            changed.add(name)

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields passed by name to the constructor or set after it (the settings contract refuses a
        value an entry point does not apply when it was asked for, even if it equals the default)."""
        return frozenset(self.__dict__.get("_given_fields", ())) | frozenset(
            self.__dict__.get("_changed_fields", ())
        )

    def asked_value(self, name: str) -> Any:
        """The value field ``name`` was given (to the constructor, or set since), before ``__post_init__``
        derived anything from it (``use_cpu`` turns ``dataloader_pin_memory`` off, for one)."""
        if name in self.__dict__.get("_changed_fields", ()):
            return getattr(self, name)
        return self.__dict__.get("_given_fields", {}).get(name, getattr(self, name))

    def validate(self) -> None:
        """Check every field again, alone and together (a field set after construction is checked here;
        ``PPOTrainer`` and ``PPOSweep`` call this when built and when ``train()`` starts).

        Raises:
            ConfigErrors: naming each bad field.
        """
        errors = bool_field_errors(self) + check_fields(self, FIELD_CHECKS)
        if not errors:
            errors = self._cross_field_errors()
        if errors:
            raise ConfigErrors("Invalid PPOConfig:", errors)

    def snapshot(self) -> dict[str, str]:
        """Every field's value as text: what an entry point was built with (see :func:`changed_fields`)."""
        return {name: repr(getattr(self, name, None)) for name in sorted(_FIELD_NAMES)}

    @property
    def local_batch_size(self) -> int:
        """Prompts per rollout batch on one device."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def local_mini_batch_size(self) -> int:
        return self.local_batch_size // self.num_mini_batches

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches accumulated into one optimizer step (one mini-batch). A mini-batch that is not a
        multiple of ``per_device_train_batch_size`` ends with a smaller micro-batch, as in TRL."""
        return max(1, math.ceil(self.local_mini_batch_size / self.per_device_train_batch_size))


_dataclass_init = PPOConfig.__init__
_FIELD_NAMES = frozenset(f.name for f in fields(PPOConfig))


@functools.wraps(_dataclass_init)
def _init_with_old_names(self, *args, **kwargs):
    from rapidfire_hf.ppo.compat import translate_legacy_config

    self.__dict__.pop("_changed_fields", None)  # dataclasses.replace builds a new object: nothing to keep
    kwargs = translate_legacy_config(kwargs)
    _dataclass_init(self, *args, **kwargs)
    given = {k: v for k, v in kwargs.items() if k in _FIELD_NAMES}
    if args:
        given["output_dir"] = args[0]
    self.__dict__["_given_fields"] = given  # as asked, before __post_init__ derived anything from them
    self.__dict__["_changed_fields"] = set()


def load_rapidfire_config(src):
    """The rapidfire config (``RapidFireConfig``) from a preset name, YAML path or dict; None for None."""
    if src is None:
        return None
    from rapidfire_hf.config import load_config
    from rapidfire_hf.utils.logs import apply_logging_config

    cfg = load_config(src)
    apply_logging_config(cfg)  # logging.level
    return cfg


def changed_fields(snapshot: dict[str, str], args: PPOConfig) -> list[str]:
    """The fields of ``args`` whose value differs from ``snapshot`` (``PPOConfig.snapshot``)."""
    now = args.snapshot()
    return [name for name in snapshot if now.get(name) != snapshot[name]]


PPOConfig.__init__ = _init_with_old_names  # the pre-1.0 TRL names, mapped with a warning (ppo/compat.py)
