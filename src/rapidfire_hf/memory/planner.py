"""The throughput planner: memory a run does not need becomes batch, and a trade is made only to fit.

``memory.optimization`` is a *target*, not an order. Each level says how much of the device a run may
plan to use and which trades it may make to fit what the user asked for (:data:`LEVEL_TARGETS`):

============  ==========================  =============================================
level         may plan to use             trades it may make
============  ==========================  =============================================
conservative  80% of the device           smaller generation / scoring chunks
balanced      85% of the device           chunks, activation recompute, host offload
auto          85% of the device           as balanced (the name of earlier versions)
aggressive    92% of the device           chunks, activation recompute, host offload, 8-bit
                                          AdamW state
============  ==========================  =============================================

Host offload (the frozen models' weights outside scoring, the optimizer state outside training:
:mod:`rapidfire_hf.memory.offload_plan`) is exact, so ``balanced`` may make it too, but only where the
room it frees changes the plan (it costs copies over the host link every update).

No level recomputes what fits: the checkpointing policy is the least recompute whose planned peak fits
the target (``memory.checkpointing: auto``). ``memory.checkpointing`` forces a policy for users who
want the memory for something else (``elementwise``, ``matmuls``) or never want recompute (``off``).

:func:`make_plan` is a pure function of what the run is (:class:`Workload`), what the user asked
(:class:`Asked`), what was measured (:class:`Probe`: activation bytes of one training row under each
checkpointing policy) and the memory the level lets it plan with (:class:`Budget`). It chooses:

- the training micro-batch: the user's ``per_device_train_batch_size`` rows, or ``k`` of the user's
  micro-batches in one forward/backward (``k`` divides the micro-batches of a mini-batch). The loss of
  such a forward is the mean of the ``k`` micro-batch losses, each normalised as before, so the gradient
  of the optimizer step is the same sum (only its floating-point grouping changes). The mini-batch, the
  rollout batch and the number of optimizer steps never change;
- the checkpointing policy (above);
- the scoring chunk (rows per no-grad scoring forward) and the generation chunk (prompts generated at
  once), each the largest that fits, unless the user set them.

Why bigger micro-batches: at 1.1B, 128 + 384 tokens, rollout batch 256 on one H200, micro-batch 32
trained in 4.65 s against 5.13 s for micro-batch 8 (separate value model) and 2.45 against 2.76 s
(fused value head), same call (``benchmarks/ppo_vs_trl/results/h200/speedups_b256``). Above
:data:`MAX_TRAIN_TOKENS` tokens per forward a bigger micro-batch adds memory, not measurable speed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.kernels.kv_quant import vector_bytes
from rapidfire_hf.memory.levels import MEMORY_LEVELS, LevelTarget, level_name

GIB = 1024**3

# checkpointing policies, least recompute first, and the cost-policy level that implements each
# (rapidfire_hf.memory.checkpointing: RECOMPUTE_BELOW)
POLICIES = ("none", "elementwise", "matmuls")
# memory.checkpointing's names ("off" = "none") -> the cost-policy level implementing each, and back
POLICY_LEVEL = {
    "none": "conservative",
    "off": "conservative",
    "elementwise": "balanced",
    "matmuls": "aggressive",
}
LEVEL_POLICY = {
    n: lv.checkpoint_policy for n, lv in MEMORY_LEVELS.items() if lv.checkpoint_policy is not None
}

# Tokens per training forward above which the planner stops merging micro-batches.
MAX_TRAIN_TOKENS = 16384
# Measured activation bytes cover what autograd keeps; backward adds the gradients of the largest
# activations and the loss temporaries on top of them. Calibrated on the H200 runs of
# benchmarks/presets/results/h200 (training peak less weights, state, gradients and kept cache, over the
# probe's bytes times the rows): 7B full fine-tuning 1.05 (micro-batches of 4 and 8), 1.1B 1.00 (batch 8)
# and 1.11 (Liger, 32 rows), 7B with `matmuls` recompute 1.03 (32 rows, one forward per step).
TRAIN_PEAK_FACTOR = 1.1
# Scoring chunks: a no-grad forward never needs more rows than this to fill an H200 at 512 tokens.
MAX_SCORING_ROWS = 256


# what each ``memory.optimization`` level lets the planner do (the one table, memory/levels.py)
LEVEL_TARGETS: dict[str, LevelTarget] = MEMORY_LEVELS
# Share of the level's target kept for activations, the KV cache and temporaries when deciding whether
# the weights, gradients and optimizer state alone leave room to train.
STATE_HEADROOM = 0.15


@dataclass(frozen=True)
class Workload:
    """The shapes of one PPO update on one device.

    Args:
        rollout_rows: prompts per rollout batch.
        mini_rows: rows per optimizer step (the mini-batch).
        micro_rows: the user's micro-batch (``per_device_train_batch_size``).
        prompt_tokens, response_tokens: tokens per row.
        hidden, layers, vocab: the policy's shape.
        kv_bytes_per_token: K and V of every layer for one token of one row, in the cache's dtype (an 8-bit
            cache with its scales: :func:`kv_bytes_per_token`).
        itemsize: bytes per activation element (2 for bf16/fp16, 4 for fp32).
        intermediate: the MLP's width (None: 8/3 of ``hidden``, Llama's ratio).
        cache_persists: the rollout engine keeps its KV cache between generations (the static engine
            reuses it, and its recorded or compiled decode step, every update), so the cache of a generation
            chunk is held through scoring and training too.
        kv_cache_dtype: the cache's elements: None (the model's dtype), ``"fp8"`` or ``"int8"``
            (``PPOConfig.rollout_kv_cache_dtype``); ``kv_bytes_per_token`` is already in it, this names it.
        kv_windows: per layer its sliding window, None for full attention (``models.plumbing.layer_windows``;
            () when no layer has one, or its cache is full-length anyway: the static engine's generic path):
            a local layer's cache holds ``min(window, tokens)`` slots (the native path's ring,
            ``rollout.llama_forward.ring_windows``; ``model.generate``'s sliding cache layers keep about as
            many), see :meth:`cache_row_bytes`.
    """

    rollout_rows: int
    mini_rows: int
    micro_rows: int
    prompt_tokens: int
    response_tokens: int
    hidden: int
    layers: int
    vocab: int
    kv_bytes_per_token: int
    itemsize: int = 2
    cache_persists: bool = False
    intermediate: int | None = None
    kv_cache_dtype: str | None = None
    kv_windows: tuple[int | None, ...] = ()

    def __post_init__(self):
        if self.kv_windows and len(self.kv_windows) != self.layers:
            raise ValueError(
                f"kv_windows has {len(self.kv_windows)} entries for {self.layers} layers: one a layer"
            )

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def cache_row_bytes(self) -> int:
        """K and V one row holds in the rollout's cache: ``tokens`` slots of every full-attention layer and
        ``min(window, tokens)`` of a local one (``kv_bytes_per_token`` is every layer's share of one token)."""
        if not self.kv_windows:
            return self.tokens * self.kv_bytes_per_token
        slots = sum(self.tokens if w is None else min(w, self.tokens) for w in self.kv_windows)
        return slots * self.kv_bytes_per_token // self.layers

    @property
    def micro_batches(self) -> int:
        """Micro-batches of the user's split in one mini-batch (the last may be smaller, as in TRL)."""
        return max(1, -(-self.mini_rows // self.micro_rows))

    @property
    def mlp_width(self) -> int:
        return self.intermediate or (8 * self.hidden) // 3

    def scoring_row_bytes(self) -> int:
        """Transient bytes of one row in a no-grad scoring forward: a layer's working set (three hidden-sized
        tensors and the MLP's gate, up and their product) and the response's last hidden states in fp32
        (log-probs are computed from them in chunks of a few hundred tokens, so full logits never exist).
        Measured on the H200 (scoring peak less what is held, per row): 7B 48-50 MiB (here 50.2), 1.1B
        23.6 MiB (here 25.5)."""
        working = self.tokens * 3 * (self.hidden + self.mlp_width) * self.itemsize
        return working + self.response_tokens * self.hidden * 4

    def held_cache_bytes(self, generation_rows: int) -> int:
        """What a generation chunk of ``generation_rows`` leaves held through scoring and training: its KV
        cache when the engine keeps it, else nothing."""
        return generation_rows * self.cache_row_bytes() if self.cache_persists else 0

    def generation_row_bytes(self) -> int:
        """Bytes one generated row holds: its KV cache (:meth:`cache_row_bytes`), the prefill's working set and
        one step's logits in fp32 (twice: the logits and the sampling probabilities)."""
        cache = self.cache_row_bytes()
        prefill = self.prompt_tokens * 16 * self.hidden * self.itemsize
        return cache + prefill + 2 * self.vocab * 4


def kv_bytes_per_token(config, itemsize: int, kv_cache_dtype: str | None = None) -> int:
    """K and V of every layer for one token of one row of a model of ``config`` (a HF config: grouped-query
    heads and an explicit ``head_dim`` respected), in a cache of ``itemsize`` bytes per element, or 8-bit
    (``kv_cache_dtype`` ``"fp8"`` / ``"int8"``: one byte per element plus one fp32 scale per head vector,
    ``kernels/kv_quant.py``; 0.516x of bf16 at head width 128)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * vector_bytes(kv_cache_dtype, itemsize, head_dim)


@dataclass(frozen=True)
class Asked:
    """What the user set: ``None`` for a setting left to the planner (``"auto"``).

    Args:
        scoring_rows: ``local_rollout_forward_batch_size``.
        generation_rows: ``rollout_generation_batch_size`` (0: the whole rollout batch, set explicitly).
        checkpointing: ``memory.checkpointing`` (``gradient_checkpointing``: HF's own, kept).
        merge: may the planner put several micro-batches in one forward (not under DeepSpeed, whose
            engine fixes the micro-batch at ``prepare``).
        planner: ``memory.planner``; ``False`` keeps the user's micro-batch split and chunks exactly
            (the ``auto`` chunks then take TRL's defaults: scoring 64 rows, the whole batch generated).
        train_rows: rows per training forward fixed by the user (``PPOSweep``'s ``train_rows_per_forward``:
            rows of several trials' micro-batches in one forward); None lets the planner merge.
        merge_any: merge any number of micro-batches, not only a divisor of a mini-batch's (``PPOSweep``
            packs its trials' micro-batches in order, the last pack smaller; one run's windows need equal
            forwards).
        split: the planner may split the user's micro-batch into pieces run one after another in the same
            accumulation window when it cannot fit whole even with the level's recompute (not under
            DeepSpeed, nor with a gradient pipeline that counts backwards itself, nor in a sweep's packs).
        kv_cache_dtype: ``PPOConfig.rollout_kv_cache_dtype`` as the user gave it, for the table (what the
            cache is in, and so its bytes, is the workload's: ``Workload.kv_cache_dtype``).
        free_cache: where the engine keeps its KV cache between generations, it may instead free it after
            each generation when keeping it would split generation into more chunks (``PPOConfig``'s
            ``rollout_cache="auto"``, its default). The cache and the recorded decode graphs are then rebuilt
            at every update (graphs recorded again; the compiled step is reused). False keeps it (this
            field's default, for callers other than PPOTrainer: ``PPOSweep``, tests).
    """

    scoring_rows: int | None = None
    generation_rows: int | None = None
    checkpointing: str = "auto"
    planner: bool = True
    merge: bool = True
    train_rows: int | None = None
    merge_any: bool = False
    free_cache: bool = False
    split: bool = True
    kv_cache_dtype: str = "auto"  # PPOConfig.rollout_kv_cache_dtype as given (the plan table's "asked")


# what "auto" means with the planner off (TRL's defaults)
UNPLANNED_SCORING_ROWS = 64


@dataclass(frozen=True)
class Probe:
    """Activation bytes one training row keeps for backward (measured, or computed from the model's shape),
    for each checkpointing policy the run may apply, least recompute first (a forced policy, or HF's own
    checkpointing: one entry)."""

    activation_bytes: dict[str, int]
    cached: bool = False  # read from the probe cache instead of measured in this run
    source: str = "measured"  # "measured", "cached" (and where) or "analytic" (memory.estimate)


@dataclass(frozen=True)
class Budget:
    """The memory a plan may use.

    Args:
        target_bytes: what the level lets the whole run hold (``device_share`` of the device).
        held_bytes: what the run holds now (weights, optimizer state, buffers).
        reserve_bytes: what the first optimizer step still adds (gradients, optimizer state).
        grad_bytes: the part of ``reserve_bytes`` that is gradients: they exist in training only (freed by
            each step's ``zero_grad``), so generation and scoring do not hold them. 0 (the default) counts
            the whole reserve in every phase.
        frozen_away: the part of ``held_bytes`` that is frozen models' weights kept in host memory outside
            scoring (:mod:`rapidfire_hf.memory.phase_offload`): generation and training do not hold them.
        state_away: the optimizer state is kept in host memory during generation and scoring.
    """

    target_bytes: int
    held_bytes: int = 0
    reserve_bytes: int = 0
    grad_bytes: int = 0
    frozen_away: int = 0
    state_away: bool = False

    @property
    def train_bytes(self) -> int:
        """Room for activations beside the weights, the optimizer state and every gradient."""
        return self.target_bytes - self.held_bytes - self.reserve_bytes

    @property
    def state_bytes(self) -> int:
        """What every phase holds once the first step ran, beyond ``held_bytes``: the optimizer state."""
        return max(0, self.reserve_bytes - self.grad_bytes)

    def holding(self, extra: int) -> Budget:
        """This budget with ``extra`` bytes more held (a kept generation cache, the engine's weight copies)."""
        return replace(self, held_bytes=self.held_bytes + extra)

    @property
    def no_grad_state(self) -> int:
        """Optimizer state held in generation and scoring (none where it is offloaded)."""
        return 0 if self.state_away else self.state_bytes

    @property
    def generation_bytes(self) -> int:
        """Room of generation: the frozen models' weights offloaded give theirs, the optimizer state is held
        unless offloaded."""
        return self.target_bytes - self.held_bytes + self.frozen_away - self.no_grad_state

    @property
    def scoring_bytes(self) -> int:
        """Room of scoring: every weight is held, the optimizer state unless offloaded."""
        return self.target_bytes - self.held_bytes - self.no_grad_state

    @property
    def training_bytes(self) -> int:
        """Room of training beside the optimizer state: the frozen models' weights offloaded give theirs."""
        return self.target_bytes - self.held_bytes + self.frozen_away - self.state_bytes


@dataclass
class Plan:
    """The planner's choices for one run (see the module docstring)."""

    level: str
    train_rows: int  # rows per training forward/backward
    merge: int  # the user's micro-batches per training forward
    checkpointing: str  # one of POLICIES
    scoring_rows: int
    generation_rows: int
    planned_peak_bytes: int
    target_bytes: int
    fits: bool
    optimizer_state: str = "as built"  # "8-bit" when the planner chose 8-bit AdamW state (aggressive)
    asked: dict = field(default_factory=dict)  # setting -> what the user asked ("auto" when left open)
    reasons: dict = field(default_factory=dict)  # setting -> why this value
    planned: bool = True  # False: memory.planner off (the user's split kept)
    # phase -> its planned peak (held + the phase's own bytes): training, scoring, generation
    phase_peak_bytes: dict = field(default_factory=dict)
    # the rollout engine frees its KV cache after each generation (Asked.free_cache): the cache is not held
    # beside scoring and training, and generation takes bigger chunks
    free_cache: bool = False
    # the rollout engine decodes with fused q/k/v and gate/up projections, holding copies of those weights
    # (:func:`decide_fused_copies`); None: the run did not consider them (not the static engine on CUDA)
    fuse_projections: bool | None = None
    # halvings of each micro-batch the plan runs up front (its pieces share the accumulation window: same
    # mini-batch and optimizer steps), where the whole micro-batch cannot fit even with the level's recompute
    splits: int = 0
    probe: str = ""  # where the activation bytes came from (Probe.source)
    # the frozen models' weights (reference, reward) in host memory outside scoring, and the optimizer state
    # in host memory during generation and scoring (memory.phase_offload; None: not considered)
    offload_frozen: bool | None = None
    offload_state: bool | None = None
    # the rollout KV cache's elements ("model dtype", "fp8", "int8": Workload.kv_cache_dtype) and its bytes
    # per token of a row (K and V of every layer; an 8-bit cache with its fp32 scales)
    kv_cache_dtype: str = "model dtype"
    kv_bytes_per_token: int = 0
    # the frozen models' precision chosen for PPOConfig's "auto" ("8bit", "4bit", "as given"; why in
    # reasons["frozen_quantization"]); None: not asked (memory.frozen_choice)
    frozen: str | None = None
    title: str = "rapidfire plan"  # the table's first words (PPOSweep: "PPOSweep plan")
    train_label: str = "training micro-batch (rows)"  # (PPOSweep: rows of all trials per training forward)

    @property
    def engine_kv_cache_dtype(self) -> str | None:
        """The rollout engine's ``kv_cache_dtype`` for this plan's cache (None: the model's dtype)."""
        return None if self.kv_cache_dtype == "model dtype" else self.kv_cache_dtype

    @property
    def forward_rows(self) -> int:
        """Rows of the largest training forward: the micro-batch, or its first piece after the plan's
        halvings (the first piece of a halving gets the odd row)."""
        rows = self.train_rows
        for _ in range(self.splits):
            rows = (rows + 1) // 2
        return rows

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(setting, asked, chosen, why)`` for the table."""
        chosen = str(self.train_rows)
        if self.splits:
            chosen += f" in {2**self.splits} pieces of {self.forward_rows}"
        return [
            (self.train_label, str(self.asked.get("train_rows")), chosen, self.reasons.get("train_rows", "")),
            ("activation checkpointing", str(self.asked.get("checkpointing")), self.checkpointing,
             self.reasons.get("checkpointing", "")),
            ("scoring chunk (rows)", str(self.asked.get("scoring_rows")), str(self.scoring_rows),
             self.reasons.get("scoring_rows", "")),
            ("generation chunk (prompts)", str(self.asked.get("generation_rows")), str(self.generation_rows),
             self.reasons.get("generation_rows", "")),
            ("optimizer state", str(self.asked.get("optimizer_state", "auto")), self.optimizer_state,
             self.reasons.get("optimizer_state", "")),
            ("KV cache dtype", str(self.asked.get("kv_cache_dtype", "auto")), self.kv_cache_dtype,
             self.reasons.get("kv_cache_dtype", "")),
            *([("rollout KV cache", "auto", "freed after generation", self.reasons.get("free_cache", ""))]
              if self.free_cache else []),
            *([("offload frozen weights", str(self.asked.get("host_offload", "auto")),
                "on" if self.offload_frozen else "off", self.reasons.get("offload_frozen", ""))]
              if self.offload_frozen is not None else []),
            *([("offload optimizer state", str(self.asked.get("host_offload", "auto")),
                "on" if self.offload_state else "off", self.reasons.get("offload_state", ""))]
              if self.offload_state is not None else []),
            *([("frozen models", "auto", self.frozen, self.reasons.get("frozen_quantization", ""))]
              if self.frozen is not None else []),
            *([("fused decode projections", str(self.asked.get("fuse_projections", "auto")),
                "on" if self.fuse_projections else "off", self.reasons.get("fuse_projections", ""))]
              if self.fuse_projections is not None else []),
        ]  # fmt: skip

    def table(self) -> str:
        """The plan as the small table the trainers print once."""
        head = (
            f"{self.title} (memory.optimization={self.level}; planned peak "
            f"{self.planned_peak_bytes / GIB:.1f} GiB of the {self.target_bytes / GIB:.1f} GiB target"
            + ("" if self.fits else "; DOES NOT FIT even in pieces of one row: expect out of memory")
            + ("" if self.planned else "; memory.planner off: your split kept")
            + ")"
        )
        rows = [("setting", "asked", "chosen", "why"), *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [head]
        if self.phase_peak_bytes:
            phases = ", ".join(f"{phase} {peak / GIB:.1f}" for phase, peak in self.phase_peak_bytes.items())
            lines.append(f"  planned peak by phase (GiB): {phases}")
        if self.probe:
            lines.append(f"  activation bytes per training row: {self.probe}")
        for r in rows:
            lines.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """The plan as tracker values (``rapidfire/plan/*``; recompute: 0 none, 1 element-wise, 2 matmuls,
        3 HF's full checkpointing)."""
        recompute = {"none": 0, "elementwise": 1, "matmuls": 2}.get(self.checkpointing, 3)
        return {
            "rapidfire/plan/train_rows": self.train_rows,
            "rapidfire/plan/merge": self.merge,
            "rapidfire/plan/splits": self.splits,
            "rapidfire/plan/forward_rows": self.forward_rows,
            "rapidfire/plan/recompute": recompute,
            "rapidfire/plan/scoring_rows": self.scoring_rows,
            "rapidfire/plan/generation_rows": self.generation_rows,
            # 1 where the rollout KV cache is 8-bit (asked, or "auto"'s choice: memory.kv_choice)
            "rapidfire/plan/kv_cache_8bit": int(self.engine_kv_cache_dtype is not None),
            "rapidfire/plan/planned_peak_gib": round(self.planned_peak_bytes / GIB, 3),
            "rapidfire/plan/target_gib": round(self.target_bytes / GIB, 3),
            **{
                f"rapidfire/plan/{phase}_peak_gib": round(peak / GIB, 3)
                for phase, peak in self.phase_peak_bytes.items()
            },
        }

    def to_dict(self) -> dict:
        return asdict(self)


def kv_cache_view(work: Workload, asked: Asked) -> dict:
    """The plan's KV-cache fields: what the cache is in, its bytes per token of a row, and why (the table's
    row "KV cache dtype")."""
    per_token = f"{work.kv_bytes_per_token / 1024:,.1f} KiB a token of a row"
    if work.kv_cache_dtype is None:
        why = f"the model's dtype: {per_token}"
        if asked.kv_cache_dtype == "auto":
            why += (
                " ('auto': int8 only where memory.optimization=aggressive's plan generates in fewer chunks "
                "with it, memory.kv_choice)"
            )
    else:
        why = (
            f"your rollout_kv_cache_dtype: {per_token} (8-bit elements, one fp32 scale per head vector; "
            "changes the arithmetic)"
        )
    return {
        "kv_cache_dtype": work.kv_cache_dtype or "model dtype",
        "kv_bytes_per_token": work.kv_bytes_per_token,
        "why": why,
    }


def _with_kv_cache(plan: Plan, work: Workload, asked: Asked) -> Plan:
    view = kv_cache_view(work, asked)
    plan.kv_cache_dtype, plan.kv_bytes_per_token = view["kv_cache_dtype"], view["kv_bytes_per_token"]
    plan.asked["kv_cache_dtype"] = asked.kv_cache_dtype
    plan.reasons["kv_cache_dtype"] = view["why"]
    return plan


def unplanned(work: Workload, asked: Asked, checkpointing: str, level="balanced") -> Plan:
    """The plan of a run without a planner (no rapidfire config): the user's split, TRL's chunks."""
    scoring = asked.scoring_rows or UNPLANNED_SCORING_ROWS
    generation = asked.generation_rows or work.rollout_rows
    plan = Plan(
        level=to_plain(level),
        train_rows=work.micro_rows,
        merge=1,
        checkpointing=checkpointing,
        scoring_rows=scoring,
        generation_rows=generation,
        planned_peak_bytes=0,
        target_bytes=0,
        fits=True,
        asked={},
        reasons={},
        planned=False,
    )
    return _with_kv_cache(plan, work, asked)


# Without a plan (no rapidfire config, or the planner could not measure), ``"auto"`` holds the fused decode
# projections' weight copies where they are at most this share of the device: 1.2 GB at 1.1B is 0.9% of an
# H200; ~9 GB at 7B (6.4%) is held only where a plan shows the room.
UNPLANNED_COPY_SHARE = 0.02


_CHOICES = {
    "train_rows": "the training micro-batch",
    "checkpointing": "recompute",
    "scoring_rows": "the scoring chunk",
    "generation_rows": "the generation chunk",
    "free_cache": "the kept KV cache",
}


def _changed(a: Plan, b: Plan) -> list[str]:
    """The choices ``b`` makes differently from ``a``, as ``"<what> <a's> -> <b's>"``."""
    return [
        f"{what} {getattr(a, name)} -> {getattr(b, name)}"
        for name, what in _CHOICES.items()
        if getattr(a, name) != getattr(b, name)
    ]


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 2**20:.1f} MiB"


def decide_fused_copies(plain: Plan, held: Plan, want, copies: int, built: int | None = None) -> Plan:
    """Whether the rollout engine holds ``copies`` bytes of fused decode projections, as a plan.

    ``plain`` is the plan without the copies, ``held`` the plan with them held (:meth:`Budget.holding`).
    ``want``: ``True`` (the user asked: ``held``, whatever it cost), ``False`` (``plain``) or ``"auto"``: the
    copies are memory spent on decode speed, so they are held only where nothing the user runs pays for them:
    ``held`` must fit and choose the same micro-batch, recompute and chunks as ``plain``; else ``plain``.
    ``built``: the bytes an engine built before this plan already holds (None: no engine yet); that engine
    stays as it is, and the device's held memory already counts its copies, so ``plain`` is the plan.
    The chosen plan's ``fuse_projections`` and its reason are set (the table's row)."""
    size, changed = _size(copies), _changed(plain, held)
    if built is not None:
        chosen, on = plain, built > 0
        why = (
            f"{_size(built)} held by the engine built before the plan"
            if on
            else "the engine was built before the plan without them"
        )
    elif want is False:
        chosen, on, why = plain, False, "your rollout_decode_fuse_projections=False"
    elif copies <= 0:
        chosen, on, why = plain, False, "no layer to fuse (LoRA, quantized or biased projections)"
    elif want is True:
        chosen, on, why = held, True, f"your rollout_decode_fuse_projections=True ({size} held)"
    elif not held.fits:
        chosen, on, why = plain, False, f"{size} of weight copies would not fit beside the plan"
    elif changed:
        chosen, on, why = plain, False, f"{size} of weight copies would change {', '.join(changed)}"
    else:
        chosen, on, why = held, True, f"{size} of weight copies fit beside the plan unchanged"
    chosen = replace(chosen, reasons=dict(chosen.reasons), asked=dict(chosen.asked))
    chosen.fuse_projections = on
    chosen.reasons["fuse_projections"] = why
    chosen.asked["fuse_projections"] = want
    return chosen


def unplanned_fused_copies(
    plan: Plan, want, copies: int, device_bytes: int, built: int | None = None
) -> Plan:
    """:func:`decide_fused_copies` for a run without a plan: ``"auto"`` holds the copies where they are at most
    :data:`UNPLANNED_COPY_SHARE` of ``device_bytes``."""
    small = 0 < copies <= UNPLANNED_COPY_SHARE * device_bytes
    held = replace(plan, fits=plan.fits and (want is True or small))
    chosen = decide_fused_copies(plan, held, want, copies, built)
    if built is None and want == "auto" and copies > 0:
        share = f"{UNPLANNED_COPY_SHARE:.0%} of the device"
        chosen.reasons["fuse_projections"] = (
            f"{_size(copies)} of weight copies, at most {share} (no plan)"
            if small
            else f"{_size(copies)} of weight copies is over {share}, and no plan shows the room "
            "(a rapidfire config plans it)"
        )
    return chosen


def level_target(level) -> LevelTarget:
    """The :class:`LevelTarget` of a ``memory.optimization`` value (enum or string).

    Raises:
        ValueError: for an unknown level, naming the allowed ones.
    """
    return LEVEL_TARGETS[level_name(level)]


def choose_optimizer_state(
    level,
    model_bytes: int,
    grad_bytes: int,
    state_bytes: int,
    state_bytes_8bit: int,
    target_bytes: int,
    available: bool = True,
) -> tuple[bool, str]:
    """Keep AdamW's state in 8 bits? Only where the level allows it (``aggressive``: 8-bit state changes
    the optimizer's arithmetic) and only when the weights, gradients and full-precision state would leave
    less than ``STATE_HEADROOM`` of the target for everything else while 8-bit state would not.

    Returns:
        ``(eight_bit, why)``.
    """
    room = (1 - STATE_HEADROOM) * target_bytes
    full = model_bytes + grad_bytes + state_bytes
    if full <= room:
        return False, "fits"
    small = model_bytes + grad_bytes + state_bytes_8bit
    if not level_target(level).eight_bit_state:
        return False, "does not fit; memory.optimization=aggressive would keep it in 8 bits"
    if not available:
        return False, "does not fit; 8-bit state needs bitsandbytes and a CUDA GPU"
    if small > room:
        return True, "8 bits, and still short of room"
    return True, f"8 bits: {full / GIB:.0f} GiB with 32-bit state would leave no room to train"


def _activations(probe: Probe, policy: str, rows: int) -> int:
    return int(TRAIN_PEAK_FACTOR * probe.activation_bytes[policy] * rows)


def train_need(probe: Probe, policy: str, rows: int, forwards: int, grad_bytes: int) -> int:
    """Bytes a training forward/backward of ``rows`` rows needs beyond the weights, the optimizer state and
    a kept cache, when ``forwards`` forwards share one optimizer step.

    With several forwards per step, the gradients of the earlier ones are held while the next one keeps its
    activations: both count. With one, backward frees each layer's activations as it makes that layer's
    gradients, so the larger of the two is the peak (7B, `matmuls`, 32 rows in one forward on the H200:
    48.8 GiB above what was held, for 52.4 GiB of activations and 12.6 GiB of gradients)."""
    act = _activations(probe, policy, rows)
    return act + grad_bytes if forwards > 1 else max(act, grad_bytes)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n))."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small) | {n // k for k in small})


def _halved(rows: int, times: int) -> int:
    for _ in range(times):
        rows = (rows + 1) // 2
    return rows


@dataclass(frozen=True)
class _Training:
    rows: int  # rows per training chunk handed to the stepper (the user's micro-batch, or merged ones)
    policy: str
    fits: bool
    splits: int  # halvings of each chunk up front
    why_rows: str
    why_policy: str


def _choose_training(work: Workload, asked: Asked, probe: Probe, budget: Budget) -> _Training:
    """The least recompute that fits the user's micro-batch (or the rows per forward the user fixed);
    where none does, the fewest halvings of the micro-batch whose pieces fit with the least recompute
    (``asked.split``); and (planner on, no recompute needed) as many of the user's micro-batches per
    forward as fit."""
    room, grads = budget.training_bytes, budget.grad_bytes
    policies = list(probe.activation_bytes)
    first = asked.train_rows or work.micro_rows
    forwards = work.micro_batches

    def fitting(rows: int, count: int) -> str | None:
        return next((p for p in policies if train_need(probe, p, rows, count, grads) <= room), None)

    policy, splits = fitting(first, forwards), 0
    can_split = asked.split and asked.planner and not asked.train_rows and asked.merge
    while policy is None and can_split and _halved(first, splits) > 1:
        splits += 1
        policy = fitting(_halved(first, splits), forwards * 2**splits)
    if policy is None:
        splits = 0
    fits = policy is not None
    forced = asked.checkpointing != "auto"
    if forced:
        why_policy = (
            f"{asked.checkpointing} set by you"
            if asked.checkpointing == "gradient_checkpointing"
            else (f"memory.checkpointing={asked.checkpointing}")
        )
    elif policy == "none":
        why_policy = "fits without recompute"
    elif fits:
        why_policy = "the least recompute that fits" + (" the pieces" if splits else "")
    else:
        why_policy = "nothing fits: the most recompute this level allows"
    policy = policy or policies[-1]
    merge, why_rows = 1, "your per_device_train_batch_size"
    if asked.train_rows:
        return _Training(asked.train_rows, policy, fits, 0, "your train_rows_per_forward", why_policy)
    if splits:
        piece = _halved(first, splits)
        why_rows = (
            f"whole it does not fit even with {policies[-1]} recompute: {2**splits} pieces of {piece} rows in "
            "one accumulation window (same mini-batch and optimizer steps)"
        )
        return _Training(first, policy, fits, splits, why_rows, why_policy)
    if not asked.planner:
        why_rows = "memory.planner off"
    elif not asked.merge:
        why_rows = "kept (DeepSpeed fixes the micro-batch)"
    elif fits and policy == "none" and not forced:
        counts = range(1, work.micro_batches + 1) if asked.merge_any else _divisors(work.micro_batches)
        for k in counts:
            rows = k * work.micro_rows
            if rows * work.tokens > max(MAX_TRAIN_TOKENS, work.micro_rows * work.tokens):
                break
            if train_need(probe, policy, rows, -(-work.micro_batches // k), grads) <= room:
                merge = k
        if merge > 1:
            why_rows = f"{merge} of your micro-batches per forward (same mini-batch and optimizer steps)"
    return _Training(merge * work.micro_rows, policy, fits, 0, why_rows, why_policy)


def _largest_chunk(total: int, row_bytes: int, room: int, cap: int, equal: bool = True) -> tuple[int, bool]:
    """The rows per chunk: ``total`` split into the fewest equal chunks that fit ``room`` (at most
    ``cap`` rows each; ``equal=False``: the most rows that fit, at most ``cap``); ``(1, False)`` when even
    one row does not fit."""
    cap = max(1, min(cap, total))
    fit_rows = room // max(1, row_bytes)
    if fit_rows < 1:
        return 1, False
    if not equal:
        return min(cap, fit_rows), True
    chunks = -(-total // min(cap, fit_rows))
    return -(-total // chunks), True


def _chunk_sizes(total: int) -> list[int]:
    """Each size of ``total`` rows in 1, 2, 3, ... equal chunks once, largest first, in O(sqrt(total)): the
    sizes ``ceil(total / k)`` for small ``k`` and every size up to ``sqrt(total)`` (a huge rollout batch must
    not cost a loop over every chunk count)."""
    root = math.isqrt(total) + 1
    return sorted(
        {-(-total // k) for k in range(1, root + 1)} | set(range(1, min(root, total) + 1)), reverse=True
    )


def _generation_chunk(
    work: Workload, asked: Asked, probe: Probe, budget: Budget
) -> tuple[int, bool, str, bool]:
    """``(rows, fits, why, free_cache)`` of the generation chunk: the largest that fits, and, where the engine
    keeps its cache through training, the largest whose cache still lets the user's micro-batch train with no
    more recompute than it needs without that cache (no level recomputes to keep a bigger generation chunk).
    With ``asked.free_cache``, a cache that would cost generation chunks is freed after each generation
    instead (``free_cache`` True: the largest chunk that fits generation alone)."""
    rows, ok = _largest_chunk(
        work.rollout_rows, work.generation_row_bytes(), budget.generation_bytes, work.rollout_rows
    )
    why = "the whole rollout batch fits" if rows == work.rollout_rows else "KV cache bounded to fit"
    if not (ok and work.cache_persists):
        return rows, ok, why, False
    alone = _choose_training(work, asked, probe, budget)
    if not alone.fits:
        return rows, ok, why, False
    # each chunk size once, largest first (the rollout batch in 1, 2, 3, ... equal chunks)
    sizes = _chunk_sizes(work.rollout_rows)
    for candidate in (n for n in sizes if n <= rows):
        beside = _choose_training(work, asked, probe, budget.holding(work.held_cache_bytes(candidate)))
        if beside.fits and (beside.policy, beside.splits) == (alone.policy, alone.splits):
            kept, freed = -(-work.rollout_rows // candidate), -(-work.rollout_rows // rows)
            if candidate < rows and asked.free_cache and freed < kept:
                why += f"; its KV cache freed after generation (kept, generation would take {kept} chunks)"
                return rows, True, why, True
            if candidate < rows:
                why = "KV cache bounded so training needs no more recompute or pieces beside it"
            return candidate, True, why, False
    return rows, ok, why, False


def make_plan(
    work: Workload,
    asked: Asked,
    probe: Probe,
    budget: Budget,
    level="balanced",
    scoring_cap: int = MAX_SCORING_ROWS,
    equal_scoring: bool = True,
) -> Plan:
    """Choose micro-batches, chunks and checkpointing for ``work`` within ``budget`` (module docstring).

    Settings the user gave (``asked``) are kept; with ``asked.planner`` off the user's micro-batch split
    is kept and the ``auto`` chunks take TRL's defaults, but the checkpointing policy still follows the
    level (no recompute that the run does not need). Where the engine keeps its KV cache between
    generations (``work.cache_persists``) the generation chunk is chosen first and its cache counts as held
    while scoring and training are planned. ``scoring_cap``: the most rows the scoring chunk may take;
    ``equal_scoring=False`` takes the most rows that fit instead of equal chunks (``PPOSweep`` packs its
    trials' pieces into chunks of at most that many rows, so an equal split would only add forwards).
    """
    level_target(level)  # validates the name
    name = to_plain(level)
    reasons, fits, free_cache = {}, True, False
    if asked.generation_rows:
        generation_rows, reasons["generation_rows"] = (
            asked.generation_rows,
            "your rollout_generation_batch_size",
        )
    elif asked.generation_rows == 0 or not asked.planner:
        generation_rows, reasons["generation_rows"] = work.rollout_rows, "the whole rollout batch"
    else:
        generation_rows, fits, reasons["generation_rows"], free_cache = _generation_chunk(
            work, asked, probe, budget
        )
    if free_cache:
        reasons["free_cache"] = "kept beside training, it would cost generation chunks (rollout_cache='auto')"
    cache = 0 if free_cache else work.held_cache_bytes(generation_rows)
    beside = budget.holding(cache)
    training = _choose_training(work, asked, probe, beside)
    train_rows, policy = training.rows, training.policy
    reasons["train_rows"], reasons["checkpointing"] = training.why_rows, training.why_policy
    fits = fits and training.fits
    merge = max(1, train_rows // work.micro_rows)
    forwards = -(-work.micro_batches // merge) * 2**training.splits
    if asked.scoring_rows is not None:
        scoring_rows, reasons["scoring_rows"] = asked.scoring_rows, "your local_rollout_forward_batch_size"
    elif not asked.planner:
        scoring_rows, reasons["scoring_rows"] = UNPLANNED_SCORING_ROWS, "TRL's default (planner off)"
    else:
        scoring_rows, ok = _largest_chunk(
            work.rollout_rows, work.scoring_row_bytes(), beside.scoring_bytes, scoring_cap, equal_scoring
        )
        fits = fits and ok
        reasons["scoring_rows"] = "the largest chunk that fits" if ok else "one row does not fit"
    # held from the first step on (in generation and scoring only where not offloaded); gradients only in
    # training (train_need); frozen weights offloaded are away in generation and training
    state, quiet, away = budget.state_bytes, budget.no_grad_state, budget.frozen_away
    piece = _halved(train_rows, training.splits)
    # a chunk larger than the rollout batch (a setting, or TRL's 64 rows) holds only the batch's rows
    scored, generated = min(scoring_rows, work.rollout_rows), min(generation_rows, work.rollout_rows)
    peaks = (
        train_need(probe, policy, piece, forwards, budget.grad_bytes) + state + cache - away,
        scored * work.scoring_row_bytes() + quiet + cache,
        generated * work.generation_row_bytes() + quiet - away,
    )
    asked_view = {
        "train_rows": asked.train_rows or work.micro_rows,
        "checkpointing": asked.checkpointing,
        "scoring_rows": asked.scoring_rows if asked.scoring_rows is not None else "auto",
        "generation_rows": (
            asked.generation_rows
            if asked.generation_rows
            else ("all" if asked.generation_rows == 0 else "auto")
        ),
    }
    plan = Plan(
        level=name,
        train_rows=train_rows,
        merge=merge,
        checkpointing=policy,
        scoring_rows=scoring_rows,
        generation_rows=generation_rows,
        planned_peak_bytes=budget.held_bytes + max(peaks),
        phase_peak_bytes={
            phase: budget.held_bytes + peak
            for phase, peak in zip(("training", "scoring", "generation"), peaks)
        },
        target_bytes=budget.target_bytes,
        fits=fits and budget.held_bytes + max(peaks) <= budget.target_bytes,
        asked=asked_view,
        reasons=reasons,
        planned=asked.planner,
        free_cache=free_cache,
        splits=training.splits,
        probe=probe.source if probe.source != "measured" else "",
    )
    return _with_kv_cache(plan, work, asked)
