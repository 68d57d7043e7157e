"""PPOTrainer's throughput plan for a card you do not have, from the model's shape alone.

:func:`card_plan` asks the same planner as a training run (:func:`rapidfire_hf.memory.planner.make_plan`),
with every number the run would measure computed instead (:mod:`rapidfire_hf.memory.estimate`): the weights,
gradients and optimizer state of every model, the activation bytes of one training row under each
checkpointing policy the level allows, the KV cache and working sets of generation and scoring. Nothing is
allocated: a 7B plan runs in a few MiB of host memory. ``rapidfire plan --gpu-memory`` prints it; the
benchmarks print it next to what a GPU run measured.

The run it plans is PPOTrainer's default on a CUDA GPU in bf16: the static rollout engine (its KV cache kept
between updates, or freed where keeping it would cost generation chunks), fused decode projections held
only where they change nothing (``rollout_decode_fuse_projections="auto"``), AdamW (8-bit state where the
level allows it and full-precision state leaves no room to train).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.estimate import (
    DecoderShape,
    RunMemory,
    analytic_probe,
    frozen_bytes,
    lora_params,
    run_memory,
)
from rapidfire_hf.memory.offload_plan import choose_offload, with_offload_of
from rapidfire_hf.memory.planner import (
    GIB,
    LEVEL_POLICY,
    Asked,
    Budget,
    Plan,
    Probe,
    Workload,
    choose_optimizer_state,
    decide_fused_copies,
    level_target,
    make_plan,
)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class RunShape:
    """What a PPO run is, for the planner, without its models.

    Args:
        shape: the policy's shape (a separate value model and a reward model take the same shape).
        rollout_rows: prompts per rollout batch (per device).
        micro_rows: ``per_device_train_batch_size``.
        mini_batches: ``num_mini_batches``.
        prompt_tokens, response_tokens: tokens per row.
        value_mode: ``"fused"`` (a value head on the policy) or ``"separate"`` (a value model).
        peft: LoRA of ``lora_rank`` on ``lora_targets`` (the reference is the base with the adapter off).
        reward_model: a reward model of the policy's shape (False: a rule reward).
        itemsize: bytes per weight and activation element (2: bf16).
        static_engine: the static rollout engine runs (the CUDA default for Llama): it keeps its KV cache
            between updates unless ``cache_kept`` is False (the plan may still free it, ``Asked.free_cache``).
        kv_cache_dtype: the rollout KV cache's elements, None (the model's dtype), ``"fp8"`` or ``"int8"``
            (``PPOConfig.rollout_kv_cache_dtype``; the static engine's native path only).
    """

    shape: DecoderShape
    rollout_rows: int
    micro_rows: int
    prompt_tokens: int
    response_tokens: int
    mini_batches: int = 1
    value_mode: str = "fused"
    peft: bool = False
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGETS
    reward_model: bool = False
    itemsize: int = 2
    static_engine: bool = True
    cache_kept: bool = True
    ref_quantization: str | None = None  # the separate reference in "8bit" or "4bit" (None: as given)
    reward_quantization: str | None = None  # the reward model in "8bit" or "4bit" (None: as given)
    kv_cache_dtype: str | None = None  # the rollout KV cache: None (the model's dtype), "fp8" or "int8"

    def workload(self) -> Workload:
        s = self.shape
        return Workload(
            rollout_rows=self.rollout_rows,
            mini_rows=max(1, self.rollout_rows // self.mini_batches),
            micro_rows=self.micro_rows,
            prompt_tokens=self.prompt_tokens,
            response_tokens=self.response_tokens,
            hidden=s.hidden,
            layers=s.layers,
            vocab=s.vocab,
            kv_bytes_per_token=s.kv_bytes_per_token(self.itemsize, self.kv_cache_dtype),
            kv_windows=s.windows,
            itemsize=self.itemsize,
            cache_persists=self.static_engine and self.cache_kept,
            intermediate=s.intermediate,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def memory(self, eight_bit_state: bool = False) -> RunMemory:
        lora = lora_params(self.shape, self.lora_rank, self.lora_targets) if self.peft else 0
        return run_memory(
            self.shape,
            value_mode=self.value_mode,
            peft=self.peft,
            lora_params=lora,
            reward_model=self.reward_model,
            itemsize=self.itemsize,
            eight_bit_state=eight_bit_state,
            ref_quantization=self.ref_quantization,
            reward_quantization=self.reward_quantization,
        )

    @property
    def has_frozen(self) -> bool:
        """A separate frozen model exists: the reference (full fine-tuning; LoRA's is the adapter-disabled
        policy) or a reward model."""
        return not self.peft or self.reward_model

    def with_frozen(self, bits: str | None, ref: bool = True, reward: bool = True) -> RunShape:
        """This run with its separate frozen models (the reference where ``ref``, the reward model where
        ``reward``) held in ``bits``; the others as they are."""
        return replace(
            self,
            ref_quantization=bits if ref and not self.peft else self.ref_quantization,
            reward_quantization=bits if reward and self.reward_model else self.reward_quantization,
        )

    def frozen_weight_bytes(self) -> int:
        """The frozen models' weights host offload may move: the reference (full fine-tuning) and the reward
        model, each unless quantized (bitsandbytes' quantized weights stay where they are)."""
        ref = 0 if self.peft or self.ref_quantization else frozen_bytes(self.shape, "lm", None, self.itemsize)
        reward = (
            frozen_bytes(self.shape, "score", None, self.itemsize)
            if self.reward_model and not self.reward_quantization
            else 0
        )
        return ref + reward

    def fused_copy_bytes(self) -> int:
        """The fused decode projections' weight copies (q/k/v and gate/up of every layer): none with LoRA
        (its layers keep their modules unless ``rollout_decode_fuse_lora``)."""
        if self.peft or not self.static_engine:
            return 0
        s = self.shape
        return s.layers * s.hidden * (s.q + 2 * s.kv + 2 * s.intermediate) * self.itemsize


def level_policies(level) -> tuple[str, ...]:
    """The checkpointing policies ``memory.optimization=level`` may apply, least recompute first."""
    if level_target(level).recompute:
        return tuple(LEVEL_POLICY.values())  # least recompute first
    return ("none",)


def card_plan(
    run: RunShape,
    device_bytes: int,
    level="balanced",
    asked: Asked | None = None,
    eight_bit_available: bool = True,
    fuse_projections="auto",
    label: str = "",
    host_offload: str = "auto",
) -> Plan:
    """The plan of ``run`` on a card of ``device_bytes`` at ``memory.optimization=level`` (module docstring).

    Args:
        asked: the settings the user fixed (default: everything ``auto``, the KV cache freed where that
            saves generation chunks, as PPOTrainer's ``rollout_cache="auto"``).
        eight_bit_available: bitsandbytes on a CUDA GPU (8-bit AdamW state may be chosen).
        fuse_projections: ``rollout_decode_fuse_projections`` (``"auto"``, True, False).
        label: named in the plan as where the activation bytes came from.
        host_offload: PPOConfig's ``host_offload`` (``"auto"``: where it pays, :mod:`rapidfire_hf.memory.
            offload_plan`; ``"on"``; ``"off"``).
    """
    asked = asked or Asked(free_cache=True, kv_cache_dtype=run.kv_cache_dtype or "auto")
    target = int(level_target(level).device_share * device_bytes)
    full = run.memory()
    eight, why_state = choose_optimizer_state(
        level, full.weights, full.gradients, full.state_full, full.state_8bit, target, eight_bit_available
    )
    mem = run.memory(eight_bit_state=eight)
    work = run.workload()
    policies = level_policies(level) if asked.checkpointing == "auto" else (asked.checkpointing,)
    separate = run.value_mode == "separate"
    probe = Probe(
        analytic_probe(
            run.shape,
            work.tokens,
            run.response_tokens,
            run.itemsize,
            policies,
            separate_value=separate,
            lora_targets=run.lora_targets if run.peft else None,
        ),
        source=f"analytic ({label or 'the model shape'}; memory.estimate)",
    )
    budget = Budget(
        target_bytes=target,
        held_bytes=mem.weights,
        reserve_bytes=mem.gradients + mem.state,
        grad_bytes=mem.gradients,
    )
    budget, plan = choose_offload(
        lambda b: make_plan(work, asked, probe, b, level),
        work,
        budget,
        run.frozen_weight_bytes(),
        level,
        host_offload,
    )
    copies = run.fused_copy_bytes() if fuse_projections is not False else 0
    if run.static_engine:
        held = make_plan(work, asked, probe, budget.holding(copies), level) if copies else plan
        plan = with_offload_of(plan, decide_fused_copies(plan, held, fuse_projections, copies))
    plan = replace(plan, reasons=dict(plan.reasons))
    plan.optimizer_state = "8-bit" if eight else "as built"
    plan.reasons["optimizer_state"] = why_state
    if not eight and why_state != "fits":
        plan.fits = False
    return plan


# the largest card the hint searches (GiB): beyond, the hint says no card does
MAX_CARD_GIB = 1 << 16


def smallest_card(run: RunShape, level, **kwargs) -> int | None:
    """The smallest card (whole GiB) on which ``run`` plans to fit, or None up to :data:`MAX_CARD_GIB`."""
    if not card_plan(run, MAX_CARD_GIB * GIB, level, **kwargs).fits:
        return None
    low, high = 0, MAX_CARD_GIB  # fits at high, not at low
    while high - low > 1:
        mid = (low + high) // 2
        if card_plan(run, mid * GIB, level, **kwargs).fits:
            high = mid
        else:
            low = mid
    return high


def fit_hint(run: RunShape, device_bytes: int, level, **kwargs) -> str:
    """One sentence saying what would make a plan that does not fit on ``device_bytes`` fit, each option
    planned: the smallest card, ``aggressive``, the frozen models or the KV cache in 8 bits, LoRA, a halved
    response. (Smaller micro-batches are the plan's own: it already tried pieces down to one row.)"""
    card = smallest_card(run, level, **kwargs)
    hints = [f"a card of at least {card} GiB (--gpu-memory)" if card else "no card up to 64 TiB"]
    if to_plain(level) != "aggressive" and card_plan(run, device_bytes, "aggressive", **kwargs).fits:
        hints.append("--config aggressive")
    if run.ref_quantization is None and run.reward_quantization is None and run.has_frozen:
        for bits in ("8bit", "4bit"):
            if card_plan(run.with_frozen(bits), device_bytes, level, **kwargs).fits:
                hints.append(
                    f"the frozen models in {bits} (--frozen-quantization {bits}; changes their arithmetic)"
                )
                break
    if (
        run.kv_cache_dtype is None
        and run.static_engine
        and card_plan(replace(run, kv_cache_dtype="int8"), device_bytes, level, **kwargs).fits
    ):
        hints.append("an 8-bit KV cache (--kv-cache-dtype int8; changes the arithmetic)")
    if not run.peft and card_plan(replace(run, peft=True), device_bytes, level, **kwargs).fits:
        hints.append("LoRA (--peft)")
    if run.response_tokens > 64:
        shorter = replace(run, response_tokens=run.response_tokens // 2)
        if card_plan(shorter, device_bytes, level, **kwargs).fits:
            hints.append(f"--response-length {shorter.response_tokens}")
    return "fits with " + ", or ".join(hints)
