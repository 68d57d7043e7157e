"""Which rapidfire_hf features hold under each distributed engine, and which fall back.

The trainers call :func:`describe_engine` once after ``accelerator.prepare`` and print
:meth:`EngineSupport.message` on the main process, so that a user launching with a DeepSpeed or
FSDP config learns at start what changes, instead of discovering it in a profile.

The table is the single place these facts live; ``docs/distributed.md`` explains each entry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

logger = logging.getLogger(__name__)


class Engine(str, Enum):
    SINGLE = "single"
    DDP = "ddp"
    ZERO1 = "deepspeed_zero1"
    ZERO2 = "deepspeed_zero2"
    ZERO3 = "deepspeed_zero3"
    FSDP1 = "fsdp1"
    FSDP2 = "fsdp2"


class Status(str, Enum):
    HOLDS = "holds"
    FALLS_BACK = "falls back"
    OFF = "off"


# feature -> engine -> (status, why). Engines not listed for a feature: HOLDS.
_PIPE_DIST = "stepped in step() after the all-reduce: per-parameter hooks fire before DDP's bucket is reduced"
_DS_OWNS = "DeepSpeed partitions gradients into its own buckets and runs the step inside engine.step()"
_FSDP_OWNS = "gradients are reduce-scattered DTensor shards; the step runs in step() on the local shard"
FEATURES: dict[str, dict[Engine, tuple[Status, str]]] = {
    "gradient_pipeline": {
        Engine.DDP: (Status.FALLS_BACK, _PIPE_DIST),
        Engine.ZERO1: (Status.FALLS_BACK, _DS_OWNS),
        Engine.ZERO2: (Status.FALLS_BACK, _DS_OWNS),
        Engine.ZERO3: (Status.FALLS_BACK, _DS_OWNS),
        Engine.FSDP1: (Status.FALLS_BACK, _FSDP_OWNS),
        Engine.FSDP2: (Status.FALLS_BACK, _FSDP_OWNS),
    },
    "rollback": {
        Engine.DDP: (Status.HOLDS, "verdict MIN-all-reduced: every rank skips the same step"),
        Engine.ZERO1: (Status.FALLS_BACK, "loss and user rules only: gradients live in DeepSpeed's buckets"),
        Engine.ZERO2: (Status.FALLS_BACK, "loss and user rules only: gradients live in DeepSpeed's buckets"),
        Engine.ZERO3: (Status.FALLS_BACK, "loss and user rules only: gradients live in DeepSpeed's buckets"),
        Engine.FSDP1: (Status.HOLDS, "verdict MIN-all-reduced; gradient norms are of the local shard"),
        Engine.FSDP2: (
            Status.HOLDS,
            "verdict MIN-all-reduced; the gradient norm is the global one (DTensor full_tensor)",
        ),
    },
    "predicted_clipping": {
        Engine.DDP: (Status.FALLS_BACK, "exact clipping in step() (the pipeline is off)"),
        Engine.ZERO1: (Status.OFF, "use DeepSpeed's gradient_clipping (accelerate maps max_grad_norm to it)"),
        Engine.ZERO2: (Status.OFF, "use DeepSpeed's gradient_clipping (accelerate maps max_grad_norm to it)"),
        Engine.ZERO3: (Status.OFF, "use DeepSpeed's gradient_clipping (accelerate maps max_grad_norm to it)"),
        Engine.FSDP1: (Status.FALLS_BACK, "clip with accelerator.clip_grad_norm_ (global norm over shards)"),
        Engine.FSDP2: (Status.FALLS_BACK, "clip with accelerator.clip_grad_norm_ (global norm over shards)"),
    },
    "memory_compaction": {},
    "adaptive_precision": {
        Engine.ZERO1: (Status.FALLS_BACK, "DeepSpeed casts the whole model to its bf16/fp16 setting"),
        Engine.ZERO2: (Status.FALLS_BACK, "DeepSpeed casts the whole model to its bf16/fp16 setting"),
        Engine.ZERO3: (
            Status.FALLS_BACK,
            "DeepSpeed casts the whole model to its bf16/fp16 setting; no sensitivity pass on partitioned weights",
        ),
        Engine.FSDP2: (
            Status.FALLS_BACK,
            "FSDP2 MixedPrecisionPolicy applies one dtype per fully_shard unit; no sensitivity pass on DTensor weights",
        ),
    },
    "fast_rollout": {
        # FSDP2 holds: the static engine runs on the policy gathered once per rollout (rollout/sharded.py)
        Engine.ZERO3: (
            Status.FALLS_BACK,
            "model.generate on the policy gathered once per rollout; rollout_backend='static' runs the engine "
            "inside that gather (checked on the CPU, not yet on GPUs)",
        ),
    },
    "sync_debug": {
        Engine.ZERO3: (Status.FALLS_BACK, "parameters are partitioned: only replicated tensors are compared"),
        Engine.FSDP2: (
            Status.FALLS_BACK,
            "parameters are DTensor shards: only replicated tensors are compared",
        ),
    },
}


@dataclass
class EngineSupport:
    """What one engine keeps of rapidfire_hf.

    Attributes:
        engine: the detected engine.
        world_size: number of processes.
        features: ``{feature: (status, reason)}`` for every feature of :data:`FEATURES`.
    """

    engine: Engine
    world_size: int
    features: dict[str, tuple[Status, str]] = field(default_factory=dict)

    def holds(self, feature: str) -> bool:
        return self.features[feature][0] is Status.HOLDS

    def fallbacks(self) -> dict[str, tuple[Status, str]]:
        return {k: v for k, v in self.features.items() if v[0] is not Status.HOLDS}

    def message(self) -> str:
        """One line per feature that does not simply hold, for the start-of-run log."""
        head = f"rapidfire_hf on {self.engine.value} ({self.world_size} process(es))"
        lines = [f"  - {name}: {status.value} ({why})" for name, (status, why) in self.fallbacks().items()]
        return head + (": all features hold" if not lines else ":\n" + "\n".join(lines))

    def table(self) -> str:
        """Every feature with its status and why, one aligned line each (what ``print()`` shows)."""
        width = max(map(len, self.features), default=0)
        head = f"rapidfire_hf on {self.engine.value} ({self.world_size} process(es))"
        rows = [
            f"  {name:<{width}}  {status.value:<10}  {why}" for name, (status, why) in self.features.items()
        ]
        return "\n".join([head, *rows])

    __str__ = table

    def to_dict(self) -> dict:
        return {
            "engine": self.engine.value,
            "world_size": self.world_size,
            "features": {k: {"status": s.value, "reason": r} for k, (s, r) in self.features.items()},
        }


def support_for(engine: Engine | str, world_size: int = 1) -> EngineSupport:
    """The feature table of ``engine`` (without an accelerator: for docs and tests)."""
    engine = Engine(engine)
    features = {
        name: per_engine.get(engine, (Status.HOLDS, "as on one device"))
        for name, per_engine in FEATURES.items()
    }
    return EngineSupport(engine, world_size, features)


def detect_engine(accelerator) -> Engine:
    """The engine an ``accelerate.Accelerator`` was configured with (from its launch config or plugins)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        stage = int(accelerator.state.deepspeed_plugin.zero_stage or 0)
        return {3: Engine.ZERO3, 2: Engine.ZERO2}.get(stage, Engine.ZERO1)
    if kind == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        return Engine.FSDP2 if version == 2 else Engine.FSDP1
    if accelerator.num_processes > 1:
        return Engine.DDP  # MULTI_GPU, MULTI_CPU (gloo) and the other multi-device types
    return Engine.SINGLE


def describe_engine(accelerator, log: bool = True) -> EngineSupport:
    """Detect the engine of ``accelerator`` and say which features hold; log it on the main process.

    Args:
        accelerator: the trainer's ``accelerate.Accelerator``.
        log: print :meth:`EngineSupport.message` (main process only) at INFO, or WARNING when a
            feature falls back.

    Returns:
        The :class:`EngineSupport` of the detected engine.
    """
    support = support_for(detect_engine(accelerator), accelerator.num_processes)
    if log and accelerator.is_main_process:
        level = logging.WARNING if support.fallbacks() else logging.INFO
        logger.log(level, support.message())
    return support
