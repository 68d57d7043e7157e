"""Optional dependencies: check for them and fail with a message naming the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache

# import name -> (pip extra of rapidfire_hf, what it is for)
OPTIONAL = {
    "wandb": ("wandb", "Weights & Biases logging"),
    "bitsandbytes": ("bnb", "8-bit optimizers and 8/4-bit frozen models"),
    "deepspeed": ("deepspeed", "DeepSpeed ZeRO"),
    "liger_kernel": ("liger", "Liger fused kernels"),
    "pynvml": ("nvml", "per-process GPU memory in `rapidfire monitor`"),
    "torchao": ("fp8", "FP8 training with torchao"),
    "triton": (None, "Triton kernels (ships with CUDA builds of torch)"),
    "vllm": (None, "the optional vLLM rollout backend"),
}


@cache
def is_available(name: str) -> bool:
    """Whether the module ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(name: str, feature: str | None = None):
    """Import and return the optional module ``name`` or raise an ImportError that says how to install it."""
    if not is_available(name):
        extra, purpose = OPTIONAL.get(name, (None, name))
        what = feature or purpose
        how = f"pip install 'rapidfire_hf[{extra}]'" if extra else f"pip install {name}"
        raise ImportError(
            f"{what} needs the optional package `{name}`, which is not installed. Install it with: {how}"
        )
    return importlib.import_module(name)
