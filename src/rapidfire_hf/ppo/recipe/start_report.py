"""What ``PPOTrainer`` prints once when ``train()`` starts: what is on, what is off and why, where the
telemetry and the process registry are (:func:`rapidfire_hf.utils.start_table.start_table`)."""

from __future__ import annotations

from dataclasses import dataclass

from rapidfire_hf.memory.planner import level_target
from rapidfire_hf.models.plumbing import unwrap_peft
from rapidfire_hf.ppo.config import engine_kv_cache_dtype
from rapidfire_hf.ppo.rollout_phase import ZERO3_ROLLOUT
from rapidfire_hf.rollout.engine import choose_decode_path
from rapidfire_hf.rollout.moe_decode import default_form_said
from rapidfire_hf.rollout.sharded import zero3_partitioned


@dataclass
class StartFacts:
    """The facts the table reports, read from a built trainer (see :func:`start_facts`)."""

    rollout: str  # the backend the rollout will use, and why when it is not the static engine
    value: str
    optimizer: str
    precision: str | None
    memory: str | None
    liger: bool
    compiled_layers: int
    planner: str | None  # None: no throughput plan (why in ``skipped``)
    skipped: list[str]


def start_facts(args, rf_config, policy, fused_value: bool, optimizer, rapidfire_optimizer, precision_plugin,
                memory_callback, kernel_patches, backend: str, device) -> StartFacts:  # fmt: skip
    """Collect the table's facts from the trainer's parts (no side effects)."""
    skipped = []
    zero3 = zero3_partitioned(policy)  # the rollout runs the engine inside a gather of the partitions
    path, reason = choose_decode_path(policy, gathered=zero3)
    kernels = [
        f"{name}={value}"
        for name, value, default in (
            ("attention", args.rollout_decode_attention, "auto"),
            ("sampler", args.rollout_decode_sampler, "torch"),
            ("fuse_projections", args.rollout_decode_fuse_projections, "auto"),
            ("linear", args.rollout_decode_linear, "torch"),
            ("fuse_lora", args.rollout_decode_fuse_lora, False),
        )
        if value != default
    ]
    if args.rollout_decode_mode != "auto":
        kernels.insert(0, f"mode={args.rollout_decode_mode}")
    unused = (
        f"rollout_decode_{', rollout_decode_'.join(kernels)} (model.generate has no decode step of its own)"
    )
    if backend == "hf":
        why = "rollout_backend='hf'" if args.rollout_backend == "hf" else ZERO3_ROLLOUT
        rollout = f"rollout: model.generate ({why})"
        skipped += [unused] if kernels else []
    elif backend == "auto" and (device.type != "cuda" or path is None):
        why = (
            reason if path is None else f"the static engine records CUDA graphs; this run is on {device.type}"
        )
        rollout = "rollout: model.generate"
        skipped.append(f"fast rollout engine ({why})")
        skipped += [unused] if kernels else []
    else:
        kernels = [k for k in kernels if not k.startswith("mode=")]
        kv_cache = engine_kv_cache_dtype(args.rollout_kv_cache_dtype)  # elsewhere refused at start
        kernels += [f"kv_cache_dtype={kv_cache}"] if kv_cache is not None else []
        level = rf_config.memory.optimization if rf_config is not None else None
        if args.rollout_kv_cache_dtype == "auto" and level is not None and level_target(level).kv_cache_8bit:
            kernels.append("kv_cache_dtype=auto (int8 where the plan then generates in fewer chunks)")
        extra = f", {', '.join(kernels)}" if kernels else ""
        # which forward the engine runs, and why not the native one (rollout.engine.choose_decode_path)
        forward = "native forward" if path == "native" else f"generic path: the model's own forward, {reason}"
        moe = default_form_said(unwrap_peft(policy), device) if path == "native" else None
        forward += f"; {moe}" if moe else ""  # how the routed experts run (rollout/moe_decode.py)
        if _sharded(policy):  # FSDP2: rollout/sharded.py, distributed/generation.py
            forward += "; FSDP2: the policy gathered once per rollout, resharded after it"
        elif zero3:  # distributed/generation.py
            forward += "; DeepSpeed ZeRO-3: the policy gathered once per rollout, partitioned after it"
        rollout = f"rollout: static engine ({forward}), decode_mode={args.rollout_decode_mode}{extra}"
    value = "value: fused head on the policy" if fused_value else "value: separate value model"
    if rapidfire_optimizer is not None:
        rf = rapidfire_optimizer
        optim = (
            f"optimizer: RapidFireOptimizer({type(rf.inner).__name__}, "
            f"pipeline={'on' if rf.pipeline_enabled else 'off'})"
        )
    else:
        optim = f"optimizer: {type(optimizer).__name__} with the finite-step guard"
    precision = None
    if precision_plugin is not None:
        precision = f"AdaptivePrecisionPlugin ({precision_plugin.mode.value}, starts in {precision_plugin.current.value})"
    elif rf_config is None:
        skipped.append("AdaptivePrecisionPlugin (no rapidfire_config)")
    else:
        skipped.append(f"AdaptivePrecisionPlugin (precision.mode={rf_config.precision.mode.value})")
    memory = None
    if memory_callback is not None:
        memory = f"MemoryCompactionCallback ({memory_callback.optimization})"
    else:
        skipped.append("MemoryCompactionCallback (memory_management=False)")
    planner = None
    if rf_config is None:
        skipped.append("throughput planner (no rapidfire_config: your micro-batch, TRL's chunks)")
    elif not rf_config.memory.planner:
        skipped.append("throughput planner (memory.planner: false keeps your split exactly)")
    else:
        planner = f"throughput planner (memory.optimization={rf_config.memory.optimization.value}; plan at update 1)"
    summary = kernel_patches.summary()
    compiled = sum(summary["compiled_layers"].values())
    return StartFacts(
        rollout, value, optim, precision, memory, bool(summary["liger"]), compiled, planner, skipped
    )


def _sharded(policy) -> bool:
    """Whether the policy's weights are FSDP2 shards (``DTensor`` parameters) between forwards."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in policy.parameters())


def start_lines(facts: StartFacts) -> tuple[list[str], list[str], bool]:
    """``(on, skipped, watched)`` for :func:`~rapidfire_hf.utils.start_table.start_table`."""
    on = [facts.rollout, facts.value, facts.optimizer]
    on += [item for item in (facts.precision, facts.memory, facts.planner) if item]
    if facts.liger:
        on.append("Liger kernels")
    if facts.compiled_layers:
        on.append(f"torch.compile of {facts.compiled_layers} decoder layers")
    return on, list(facts.skipped), facts.memory is not None
