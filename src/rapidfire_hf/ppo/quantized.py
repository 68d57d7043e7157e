"""Frozen reference and reward models in 8-bit or 4-bit (bitsandbytes), loaded through ``from_pretrained``.

PPO keeps two frozen models beside the trained ones: the reference policy (for the KL term) and, with a
learned reward, the reward model. Neither needs gradients or optimizer state, so holding them in 8-bit
(about half of bf16) or 4-bit NF4 (about a quarter) frees memory for larger rollout batches. The price is
a small difference in their outputs: the KL term starts slightly above 0 instead of exactly 0.

Quantization goes through the real loading path (``from_pretrained(..., quantization_config=...)``):
:func:`load_quantized` loads a checkpoint directory or hub id, and :func:`quantized_copy` turns a model
in memory into a quantized frozen copy by saving it to a temporary directory and loading it back.
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn

from rapidfire_hf.utils.imports import require

QUANTIZATION = ("8bit", "4bit")


def check_quantization(value: str | None, name: str) -> None:
    if value is not None and value not in QUANTIZATION:
        raise ValueError(f"{name}={value!r}: allowed None, '8bit' or '4bit'")


def bnb_config(bits: str, compute_dtype: torch.dtype = torch.bfloat16):
    """The ``BitsAndBytesConfig`` for ``"8bit"`` or ``"4bit"`` (NF4 with double quantization)."""
    check_quantization(bits, "quantization")
    require("bitsandbytes", f"Loading a frozen model in {bits}")
    from transformers import BitsAndBytesConfig

    if bits == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_quantized(
    path: str,
    bits: str,
    model_class=None,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    **kwargs,
) -> nn.Module:
    """Load a frozen model in ``bits`` ("8bit" or "4bit") onto ``device``, in eval mode, without gradients.

    Args:
        path: a checkpoint directory or hub id.
        bits: ``"8bit"`` or ``"4bit"``.
        model_class: e.g. ``AutoModelForCausalLM`` (default) or ``AutoModelForSequenceClassification``.
        device: where the weights go (default: the current CUDA device, else CPU).
        compute_dtype: dtype of the 4-bit matmuls.
        **kwargs: passed to ``from_pretrained``.
    """
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    model = model_class.from_pretrained(
        path,
        quantization_config=bnb_config(bits, compute_dtype),
        device_map={"": torch.device(device)},
        **kwargs,
    )
    model.requires_grad_(False)
    return model.eval()


def quantized_copy(model: nn.Module, bits: str, device=None, compute_dtype=None) -> nn.Module:
    """A frozen ``bits`` copy of ``model`` (saved to a temporary directory and loaded back quantized)."""
    if is_quantized(model):
        raise ValueError("the model is already quantized: pass it as it is")
    compute_dtype = compute_dtype or next(model.parameters()).dtype
    if compute_dtype == torch.float32:
        compute_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with tempfile.TemporaryDirectory(prefix="rapidfire-quantize-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        return load_quantized(tmp, bits, type(model), device=device, compute_dtype=compute_dtype)


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes-quantized weights (it must not be moved with ``.to()``)."""
    return bool(
        getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "is_loaded_in_4bit", False)
        or getattr(getattr(model, "hf_quantizer", None), "quantization_config", None) is not None
    )
