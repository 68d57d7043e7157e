"""PPOConfig: TRL 1.12's PPO arguments on top of ``transformers.TrainingArguments``, plus rapidfire options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments


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
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate of AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N PPO updates."})
    save_strategy: str = field(default="no", metadata={"help": "'no' or 'steps' (every save_steps updates)."})

    # PPO (TRL 1.12 names and defaults).
    num_mini_batches: int = field(
        default=1, metadata={"help": "Mini-batches per rollout batch (optimizer steps per epoch)."}
    )
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Prompts to train on in total (default: num_train_epochs * len(train_dataset))."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Rows per no-grad forward in the scoring phase (per device)."}
    )
    response_length: int = field(
        default=53, metadata={"help": "Maximum number of generated response tokens."}
    )
    stop_token: str | None = field(
        default=None, metadata={"help": "'eos' to stop at the tokenizer's EOS, or None."}
    )
    stop_token_id: int | None = field(
        default=None, metadata={"help": "Token id that ends a response (exclusive with stop_token)."}
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling filter (0 = off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling filter (1.0 = off)."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of responses that contain no EOS (positive)."},
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "PPO epochs over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the shaped rewards."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient."})
    kl_estimator: str = field(
        default="k1", metadata={"help": "KL estimator for the reward penalty: 'k1' or 'k3'."}
    )
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value prediction clip range."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions (default: all 1.0)."}
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Truncate prompts (left) to this many tokens."}
    )
    dataset_text_field: str = field(default="prompt", metadata={"help": "Column holding the prompt text."})
    num_sample_generations: int = field(
        default=0,
        metadata={
            "help": "Print a table of sampled prompts, completions and scores this many times (0 = never)."
        },
    )

    # rapidfire_hf.
    memory_management: bool = field(
        default=True,
        metadata={
            "help": "Attach MemoryCompactionCallback (allocator setup, phase-boundary compaction, telemetry)."
        },
    )
    max_oom_splits: int = field(
        default=3,
        metadata={
            "help": "On CUDA OOM in a micro-batch, halve it and retry up to this many times (0 = never)."
        },
    )
    approx_kl_limit: float | None = field(
        default=None,
        metadata={
            "help": "With a RapidFireOptimizer: roll back an optimizer step whose approx-KL exceeds this."
        },
    )
    value_mode: str = field(
        default="separate",
        metadata={
            "help": "'separate': a value model beside the policy (TRL parity). 'fused': a value head on the "
            "policy's last hidden state, so one forward gives log-probs and values. The fused trunk's "
            "optimizer step follows the sum of the policy and value gradients, so the policy moves less "
            "per step at the same learning rate: on the learning benchmark the fused head's best rate "
            "was about 3x the separate mode's (1e-3 against 3e-4; benchmarks/ppo_vs_trl)."
        },
    )
    ref_model_quantization: str | None = field(
        default=None,
        metadata={
            "help": "Hold the frozen reference policy in '8bit' or '4bit' (bitsandbytes NF4); None keeps it as "
            "given. Not with LoRA (the reference is then the adapter-disabled policy itself)."
        },
    )
    reward_model_quantization: str | None = field(
        default=None,
        metadata={"help": "Hold the frozen reward model in '8bit' or '4bit' (bitsandbytes); None keeps it."},
    )
    rollout_backend: str = field(
        default="auto",
        metadata={"help": "'auto' (fast engine on GPU, model.generate elsewhere), 'static' or 'hf'."},
    )
    rollout_decode_mode: str = field(
        default="auto",
        metadata={
            "help": "Decode step of the fast engine: 'auto' (torch.compile + CUDA graph on GPU for the first "
            "four batch shapes, then CUDA graph alone), 'compile', 'cuda_graph' or 'eager'."
        },
    )
    rollout_generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Prompts generated at once (per device); None generates the whole rollout batch together. "
            "The rollout engine's KV cache grows with this (about 11.5 MB per sequence for a 1.1B Llama at "
            "512 tokens), so set it to run rollout batches larger than one generation fits."
        },
    )
    rapidfire_config: Any = field(
        default=None,
        metadata={
            "help": "A rapidfire config: YAML path, preset name, dict (short or nested form) or RapidFireConfig."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        errors = []
        if self.kl_estimator not in ("k1", "k3"):
            errors.append(f"kl_estimator={self.kl_estimator!r}: allowed 'k1' or 'k3'")
        if self.value_mode not in ("separate", "fused"):
            errors.append(f"value_mode={self.value_mode!r}: allowed 'separate' or 'fused'")
        if self.rollout_backend not in ("auto", "static", "hf"):
            errors.append(f"rollout_backend={self.rollout_backend!r}: allowed 'auto', 'static' or 'hf'")
        for name in ("ref_model_quantization", "reward_model_quantization"):
            value = getattr(self, name)
            if value is not None and value not in ("8bit", "4bit"):
                errors.append(f"{name}={value!r}: allowed None, '8bit' or '4bit'")
        if self.rollout_decode_mode not in ("auto", "compile", "cuda_graph", "eager"):
            errors.append(
                f"rollout_decode_mode={self.rollout_decode_mode!r}: allowed 'auto', 'compile', 'cuda_graph' or 'eager'"
            )
        if self.stop_token not in (None, "eos"):
            errors.append(
                f"stop_token={self.stop_token!r}: allowed 'eos' or None (use stop_token_id for others)"
            )
        if self.stop_token is not None and self.stop_token_id is not None:
            errors.append("stop_token and stop_token_id are both set: set only one")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            errors.append(f"missing_eos_penalty={self.missing_eos_penalty}: must be a positive value")
        for name in (
            "num_mini_batches",
            "num_ppo_epochs",
            "response_length",
            "local_rollout_forward_batch_size",
        ):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)}: must be >= 1")
        if self.rollout_generation_batch_size is not None and self.rollout_generation_batch_size < 1:
            errors.append(
                f"rollout_generation_batch_size={self.rollout_generation_batch_size}: must be >= 1, or None "
                "for the whole rollout batch at once"
            )
        if self.temperature <= 0:
            errors.append(f"temperature={self.temperature}: must be > 0")
        if (self.per_device_train_batch_size * self.gradient_accumulation_steps) % self.num_mini_batches:
            errors.append(
                "per_device_train_batch_size * gradient_accumulation_steps = "
                f"{self.per_device_train_batch_size * self.gradient_accumulation_steps} is not divisible by "
                f"num_mini_batches={self.num_mini_batches}"
            )
        elif (self.local_batch_size // self.num_mini_batches) % self.per_device_train_batch_size:
            errors.append(
                f"a mini-batch of {self.local_batch_size // self.num_mini_batches} prompts is not a multiple of "
                f"per_device_train_batch_size={self.per_device_train_batch_size}: lower num_mini_batches or raise "
                "gradient_accumulation_steps"
            )
        if errors:
            raise ValueError("Invalid PPOConfig:\n  - " + "\n  - ".join(errors))

    @property
    def local_batch_size(self) -> int:
        """Prompts per rollout batch on one device."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def local_mini_batch_size(self) -> int:
        return self.local_batch_size // self.num_mini_batches

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches accumulated into one optimizer step (one mini-batch)."""
        return max(1, self.local_mini_batch_size // self.per_device_train_batch_size)
