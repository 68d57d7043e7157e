"""The ``memory.optimization`` levels in one table: what each level lets a run do.

Every other spelling of the levels is derived from :data:`MEMORY_LEVELS` (the planner's device share and
8-bit choice, the compaction interval of the memory callback, the recompute threshold and policy of
selective checkpointing); the config's ``MemoryLevel`` names and the preset YAML files are checked against
it by ``tests/memory/test_levels.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidfire_hf.config.schema import to_plain


@dataclass(frozen=True)
class LevelTarget:
    """One ``memory.optimization`` level.

    Attributes:
        name: as spelled in the config.
        device_share: share of the device's total memory the run may plan to use.
        recompute: may trade compute for memory (activation checkpointing) to fit.
        eight_bit_state: may keep AdamW's state in 8 bits (changes the optimizer's arithmetic).
        offload: may move the frozen models' weights and the optimizer state to host memory while a phase
            does not read them (:mod:`rapidfire_hf.memory.phase_offload`; exact: the arithmetic is unchanged,
            the copies cost time), chosen only where the room it frees changes the plan.
        frozen_quantization: may hold the frozen reference and reward models in 8 or 4 bits where PPOConfig
            asks ``"auto"`` (changes their arithmetic: :mod:`rapidfire_hf.memory.frozen_choice`).
        kv_cache_8bit: may store the rollout KV cache in int8 where PPOConfig's ``rollout_kv_cache_dtype`` is
            ``"auto"`` (changes generation's arithmetic: :mod:`rapidfire_hf.memory.kv_choice`).
        compaction_interval: fewest optimizer steps between two threshold compactions (a compaction makes
            the next step cudaMalloc its activations again, so lazier levels wait longer).
        checkpoint_policy: the selective-checkpointing policy the level stands for (``"none"``,
            ``"elementwise"``, ``"matmuls"``), or None where it is chosen by measurement (``auto``).
        recompute_below: recompute an op whose output costs fewer FLOPs than this per byte kept (None:
            nothing is recomputed by this level's own policy).
    """

    name: str
    device_share: float
    recompute: bool
    eight_bit_state: bool
    compaction_interval: int
    checkpoint_policy: str | None
    recompute_below: float | None
    offload: bool = False
    frozen_quantization: bool = False
    kv_cache_8bit: bool = False


# least recompute first: the order selective checkpointing tries the policies in
MEMORY_LEVELS: dict[str, LevelTarget] = {
    level.name: level
    for level in (
        LevelTarget("conservative", 0.80, False, False, 50, "none", None),
        LevelTarget("balanced", 0.85, True, False, 20, "elementwise", 16.0, offload=True),
        LevelTarget(
            "aggressive", 0.92, True, True, 5, "matmuls", 4096.0, offload=True, frozen_quantization=True,
            kv_cache_8bit=True,
        ),
        LevelTarget("auto", 0.85, True, False, 20, None, None, offload=True),
    )
}
DEFAULT_LEVEL = "balanced"


def level_name(level) -> str:
    """A level as its config string (the config's enum or a string), checked against the table.

    Raises:
        ValueError: an unknown level, naming the allowed ones.
    """
    name = to_plain(level)  # the config's MemoryLevel enum or a string
    if name not in MEMORY_LEVELS:
        raise ValueError(f"memory.optimization={name!r}: expected one of {', '.join(MEMORY_LEVELS)}")
    return name
