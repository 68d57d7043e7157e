"""The checks of ``RapidFireOptimizer``'s constructor arguments.

:func:`check_options` raises on the first bad value, with a message that says what is allowed,
before the optimizer builds any state or touches a weight; it returns the values it normalises.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from rapidfire_hf.optim.inner import check_inner_kwargs, resolve_inner_class
from rapidfire_hf.optim.pipeline import check_bucket_mb, check_depth, check_overlap, check_share
from rapidfire_hf.optim.skips import check_limit
from rapidfire_hf.optim.snapshot import WHERE as SNAPSHOT_WHERE

ROLLBACK = ("off", "auto")
CLIP_PREDICTION = ("exact", "scale")

# names from articles and snippets that are not settings of this optimizer, and what to use instead
NOT_SETTINGS = {
    "acceleration_factor": "the speed-ups are gradient_pipeline=True here and PPOConfig(torch_compile=True, "
    "use_liger_kernel=True) in the trainer; there is no single factor to set",
    "memory_optimization": "set it in the rapidfire config: PPOConfig(rapidfire_config={'memory_optimization': ...})",
}


def check_options(
    *,
    params: Iterable | None,
    optimizer: str | type | torch.optim.Optimizer,
    inner_kwargs: dict[str, Any],
    precision: str | None,
    gradient_pipeline: bool,
    rollback: str,
    accumulation_steps: int | None,
    max_grad_norm: float | None,
    snapshot: str,
    snapshot_interval: int,
    sync_interval: int,
    grad_z_threshold: float,
    loss_z_threshold: float,
    clip_headroom: float,
    warmup_steps: int,
    max_consecutive_skips: int | None,
    clip_prediction: str | None,
    clip_tolerance: float,
    pipeline_bucket_mb: float,
    pipeline_overlap: float,
    pipeline_share: float,
    pipeline_depth: int | None,
    side_stream_depth: int | None,
    enable_fused_kernels: bool | None,
) -> dict[str, Any]:
    """Check ``RapidFireOptimizer(...)``'s arguments (see its docstring for each), in a fixed order.

    Returns:
        The normalised values: ``clip_prediction`` (None resolved to ``"exact"``; formerly ``"scale"`` when ``max_grad_norm``
        is set and ``rollback="auto"``, else ``"exact"``), ``pipeline_bucket_mb``, ``pipeline_overlap``
        and ``pipeline_share`` as floats, and ``pipeline_depth``.

    Raises:
        ValueError: a value out of its range or not one of its choices, or two settings that cannot be
            combined (``precision="fp16"`` with the pipeline, ``sync_interval`` and ``snapshot_interval``
            both above 1, ``clip_prediction="scale"`` without ``max_grad_norm`` or ``rollback="auto"``);
            also an unknown inner optimizer name (from :func:`~rapidfire_hf.optim.inner.resolve_inner_class`).
        TypeError: a name of :data:`NOT_SETTINGS` among ``inner_kwargs``, hyper-parameters or params
            passed with an optimizer instance, or a keyword the inner optimizer does not take.
        ImportError: the inner optimizer needs bitsandbytes and it is not installed.
    """
    if precision not in (None, "bf16", "fp16"):
        raise ValueError(
            f"precision={precision!r}: choose 'bf16', 'fp16' or None (the trainer's own setting)"
        )
    if precision == "fp16" and gradient_pipeline:
        raise ValueError(
            "precision='fp16' needs loss scaling, and the gradient pipeline would step the scaled gradients "
            "inside backward: use precision='bf16' (no loss scaling) or gradient_pipeline=False"
        )
    for name, hint in NOT_SETTINGS.items():
        if name in inner_kwargs:
            raise TypeError(f"RapidFireOptimizer({name}=...) is not a setting: {hint}")
    if rollback not in ROLLBACK:
        raise ValueError(f"rollback={rollback!r}: choose one of {ROLLBACK}")
    if accumulation_steps is not None and (not isinstance(accumulation_steps, int) or accumulation_steps < 1):
        raise ValueError(f"accumulation_steps={accumulation_steps!r}: must be an int >= 1 or None")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be > 0 or None (no clipping)")
    if not isinstance(snapshot_interval, int) or snapshot_interval < 1:
        raise ValueError(f"snapshot_interval={snapshot_interval!r}: must be an int >= 1")
    if isinstance(sync_interval, bool) or not isinstance(sync_interval, int) or sync_interval < 1:
        raise ValueError(f"sync_interval={sync_interval!r}: must be an int >= 1 (1: verify every step)")
    if sync_interval > 1 and snapshot_interval > 1:
        raise ValueError(
            f"sync_interval={sync_interval} and snapshot_interval={snapshot_interval}: with sync_interval > 1 "
            "the snapshot is taken at each verified boundary; leave snapshot_interval at 1."
        )
    for name, value in (
        ("grad_z_threshold", grad_z_threshold),
        ("loss_z_threshold", loss_z_threshold),
        ("clip_headroom", clip_headroom),
    ):  # a NaN threshold would pass every check; a string would fail only at the first comparison
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name}={value!r}: must be a finite number > 0")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: must be an int >= 0")
    if clip_prediction is None:  # a miss costs a whole window: "scale" only when asked for by name
        clip_prediction = "exact"
    if clip_prediction not in CLIP_PREDICTION:
        raise ValueError(f"clip_prediction={clip_prediction!r}: choose one of {CLIP_PREDICTION}")
    if not 0.0 < clip_tolerance < 1.0:
        raise ValueError(f"clip_tolerance={clip_tolerance!r}: must be in (0, 1), e.g. 0.05 for 5%")
    if clip_prediction == "scale" and (max_grad_norm is None or rollback != "auto"):
        raise ValueError(
            "clip_prediction='scale' needs max_grad_norm (there is nothing to predict without "
            "clipping) and rollback='auto' (a missed prediction must be undone); got "
            f"max_grad_norm={max_grad_norm!r}, rollback={rollback!r}."
        )
    checked = {
        "clip_prediction": clip_prediction,
        "pipeline_bucket_mb": check_bucket_mb(pipeline_bucket_mb),
        "pipeline_overlap": check_overlap(pipeline_overlap),
        "pipeline_share": check_share(pipeline_share),
        "pipeline_depth": check_depth(pipeline_depth),
    }
    if side_stream_depth is not None and (
        isinstance(side_stream_depth, bool) or not isinstance(side_stream_depth, int) or side_stream_depth < 1
    ):
        raise ValueError(f"side_stream_depth={side_stream_depth!r}: must be an int >= 1 or None (no limit)")
    if isinstance(optimizer, torch.optim.Optimizer):
        if inner_kwargs or enable_fused_kernels is not None:
            raise TypeError(
                "An optimizer instance already has its hyper-parameters: do not also pass "
                f"{sorted(inner_kwargs) + (['enable_fused_kernels'] if enable_fused_kernels is not None else [])}."
            )
        if params is not None:
            raise TypeError("An optimizer instance already holds its parameters: do not also pass params.")
    else:
        check_inner_kwargs(resolve_inner_class(optimizer), inner_kwargs)
    check_limit("max_consecutive_skips", max_consecutive_skips)  # what SkipStreak takes (it checks it too)
    if snapshot not in ("auto", *SNAPSHOT_WHERE):
        raise ValueError(f"snapshot={snapshot!r}: choose one of {('auto', *SNAPSHOT_WHERE)}")
    return checked
