"""Reading the files of a checkpoint safely: tensors and plain values only, finite, the file named.

Every ``.pt`` file is read with ``torch.load(weights_only=True)``: a checkpoint cannot run code, and a
pickled object is refused unread. Weights come from safetensors files. Non-finite values in weights or
optimizer state are refused naming the tensor: a resumed run would otherwise train on NaN until it dies.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from rapidfire_hf.checkpoint.errors import CheckpointDamagedError

_UNSAFE = re.compile(r"\bGLOBAL\b|unsupported global|unsupported class", re.IGNORECASE)  # torch's refusals


def read_pt(path: Path, what: str):
    """``torch.load(weights_only=True)`` on the CPU; errors name the file.

    Raises:
        CheckpointError: the file holds Python objects other than tensors and plain values (refused unread:
            unpickling them could run code).
        CheckpointDamagedError: the file is missing or cannot be read as ``what``.
    """
    if not path.is_file():
        raise CheckpointDamagedError(path, "is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, EOFError, RuntimeError, ... depending on the damage
        if _UNSAFE.search(str(e)):
            raise CheckpointDamagedError(
                path,
                f"holds Python objects other than tensors and plain values (a {what} saved by rapidfire_hf "
                "never does); refusing to unpickle them, as that could run code",
            ) from None
        raise CheckpointDamagedError(path, f"cannot be read as a {what}", e) from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; errors name the file."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointDamagedError(path, "is missing")
    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError
        raise CheckpointDamagedError(path, "cannot be read as safetensors weights", err) from None


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object; errors name the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointDamagedError(path, f"cannot be read as {what}", err) from None
    if not isinstance(data, dict):
        raise CheckpointDamagedError(path, f"cannot be read as {what} (a JSON {type(data).__name__})")
    return data


def first_non_finite(value, where: str = "") -> str | None:
    """The path (``state/3/exp_avg``) of the first floating tensor holding a NaN or an infinity inside
    nested dicts, lists and tuples; None when every one is finite."""
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            return where or "tensor"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        bad = first_non_finite(item, f"{where}/{key}" if where else str(key))
        if bad is not None:
            return bad
    return None


def require_finite(path: Path, value, what: str) -> None:
    """Refuse ``value`` (read from ``path``) when a tensor in it is not finite, naming the tensor.

    Raises:
        CheckpointDamagedError: ``<path> holds NaN or infinite values in <what> tensor <name>``.
    """
    bad = first_non_finite(value)
    if bad is not None:
        raise CheckpointDamagedError(
            path,
            f"holds NaN or infinite values in {what} tensor {bad}: the run had diverged when it was saved, "
            "and resuming would train on them",
        )


def require_tensors(path: Path, value, what: str) -> dict:
    """``value`` as a mapping of tensors (a state dict), else refused naming the file."""
    if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
        raise CheckpointDamagedError(path, f"does not hold a {what} (a mapping of tensors)")
    return value
