"""Reward functions for PPO: calling them and checking what they return.

A reward function is ``f(prompts, completions, completion_ids, **columns)`` and returns one score per
completion: a list or tuple of real numbers (Python, NumPy or 0-d tensor scalars; ``True``/``False`` count
as 1/0), or a 1-D tensor or array. Anything else (a dict, a string, a generator, a 2-D array, a score that is
not a number, a wrong count) is refused with a ``TypeError``/``ValueError`` naming the function and what
it should return, before the scores reach an update. Non-finite scores (NaN, inf) are passed on: the
trainer's non-finite guard skips the step they would poison.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rapidfire_hf.config.errors import quote

EXPECTED = "a list (or 1-D tensor/array) of floats, one per completion"


def reward_name(func: Callable) -> str:
    """How error messages name a reward function: its qualified name, else its class."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    return name or type(func).__name__


def check_scores(func: Callable, values: Any, count: int) -> torch.Tensor:
    """``values`` returned by reward function ``func`` as a float32 tensor of ``count`` scores.

    Raises:
        TypeError: ``values`` is not a list/tuple of real numbers or a 1-D tensor/array.
        ValueError: it holds a number of scores other than ``count``, or is not 1-D.
    """
    where = f"reward function {reward_name(func)!r} returned"
    if isinstance(values, torch.Tensor) or _is_array(values):
        scores = torch.as_tensor(values).detach()
        if scores.dim() != 1:
            raise ValueError(
                f"{where} a {scores.dim()}-D {type(values).__name__} of shape {tuple(scores.shape)}; "
                f"expected {EXPECTED} (shape ({count},))"
            )
        if scores.is_complex() or not (scores.is_floating_point() or scores.dtype in _INT_DTYPES):
            raise TypeError(f"{where} a tensor of {scores.dtype}; expected {EXPECTED}")
        scores = scores.to("cpu", torch.float32)
    elif isinstance(values, (list, tuple)):
        scores = torch.tensor([_score(where, i, v) for i, v in enumerate(values)], dtype=torch.float32)
    else:
        raise TypeError(f"{where} {_describe(values)}; expected {EXPECTED}")
    if scores.numel() != count:
        raise ValueError(f"{where} {scores.numel()} scores for {count} completions; expected {EXPECTED}")
    return scores


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


def _is_array(values: Any) -> bool:
    return type(values).__module__ == "numpy" and hasattr(values, "ndim")


def _score(where: str, index: int, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if _is_array(value) and value.ndim == 0 and value.dtype.kind in "biuf":
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{where} score {index} = {quote(value)} ({type(value).__name__}); expected {EXPECTED}")


def _describe(values: Any) -> str:
    if values is None:
        return "None"
    if isinstance(values, dict):
        return f"a dict (keys {quote(list(values)[:5])})"
    if isinstance(values, (str, bytes)):
        return f"a {type(values).__name__} {quote(values)}"
    if hasattr(values, "__next__"):
        return f"an iterator ({type(values).__name__}); return a list instead"
    return f"a {type(values).__name__} ({quote(values)})"


def reward_funcs_scores(
    funcs: Sequence[Callable],
    weights: Sequence[float] | None,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The weighted sum of every reward function's checked scores, a float32 CPU tensor ``[len(completions)]``.

    Args:
        funcs: the reward functions, each called as ``f(prompts=..., completions=..., completion_ids=...,
            **columns)``.
        weights: one weight per function (None: 1.0 each).
        columns: the dataset's other columns for this batch, one list entry per prompt.
    """
    check_weights(weights, len(funcs))
    return weighted_scores(reward_columns(funcs, prompts, completions, completion_ids, columns), weights)


def check_weights(weights: Sequence[float] | None, num_funcs: int) -> None:
    """Raise ValueError unless ``weights`` is None or holds one weight per reward function."""
    if weights is not None and len(weights) != num_funcs:
        raise ValueError(
            f"reward_weights has {len(weights)} entries for {num_funcs} reward functions: give one per function"
        )


def reward_columns(
    funcs: Sequence[Callable],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Every reward function's checked scores, one column per function: float32 on the CPU,
    ``[len(completions), len(funcs)]`` (a sweep calls the functions once for every trial's rows)."""
    cols = []
    for func in funcs:
        values = func(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **(columns or {})
        )
        cols.append(check_scores(func, values, len(completions)))
    if not cols:
        return torch.zeros(len(completions), 0)
    return torch.stack(cols, dim=1)


def weighted_scores(columns: torch.Tensor, weights: Sequence[float] | None) -> torch.Tensor:
    """Each row's reward: ``sum_j weights[j] * columns[:, j]``, added in the functions' order (None: 1.0
    each). ``columns`` ``[rows, functions]``; returns ``[rows]`` float32 on its device."""
    weights = list(weights) if weights is not None else [1.0] * columns.shape[1]
    total = torch.zeros(columns.shape[0], dtype=torch.float32, device=columns.device)
    for j, weight in enumerate(weights):
        total += weight * columns[:, j]
    return total
