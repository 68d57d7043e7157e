"""bitsandbytes 8-bit optimizer pieces: no per-parameter device sync on the default stream, and the
embedding's AdamW state in 8 bits too. bitsandbytes is imported inside each function (extra: ``bnb``).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch


def skip_bitsandbytes_sync_on_default_stream() -> bool:
    """Make bitsandbytes' optimizers skip their per-parameter ``torch.cuda.synchronize()`` on the default stream.

    Returns False when bitsandbytes is not installed; applying it twice is a no-op (process-wide: it
    replaces ``bitsandbytes.optim.optimizer.sync_gpu``).

    ``bitsandbytes.optim.Optimizer8bit.step`` calls ``sync_gpu(p)`` (a full device sync) after every
    parameter's update. The sync exists for paged state (unified memory the host may touch); with device
    state every kernel of the update is launched on the default stream (bitsandbytes 0.50 passes no stream
    to its 8-bit kernels), so whatever runs next on that stream is ordered after it without a host wait.
    This wrapper skips the sync only when the tensor is on CUDA and the current stream is the default
    stream; anywhere else (another current stream, e.g. a side stream of the gradient pipeline) it syncs
    as before. Do not use with paged optimizers (``is_paged=True``): their final sync goes through the same
    function. Why: RapidFireOptimizer's gradient pipeline steps buckets from backward hooks, where each
    sync (one per parameter, ~200 for a 1.1B Llama) drains the device queue.
    """
    try:
        import bitsandbytes.optim.optimizer as bnb_optimizer
    except ImportError:
        return False
    original = bnb_optimizer.sync_gpu
    if getattr(original, "_rapidfire_skips_default_stream", False):
        return True

    @functools.wraps(original)
    def sync_gpu(t: torch.Tensor):
        if t.device.type == "cuda" and torch.cuda.current_stream(t.device) == torch.cuda.default_stream(
            t.device
        ):
            return None
        return original(t)

    sync_gpu._rapidfire_skips_default_stream = True
    bnb_optimizer.sync_gpu = sync_gpu
    return True


def use_8bit_embedding_state(trainer) -> dict:
    """Make ``trainer`` build bitsandbytes' ``AdamW8bit`` with its own ``optim="adamw_8bit"`` arguments,
    without transformers' override that keeps ``nn.Embedding`` state in 32 bits.

    ``Trainer.create_optimizer`` registers that override only when the optimizer kwargs hold
    ``optim_bits=8``; ``AdamW8bit`` is 8-bit without the key. Param groups, lr, betas and eps stay the
    trainer's (``Trainer.get_optimizer_cls_and_kwargs`` for the same args), set as the trainer's
    ``optimizer_cls_and_kwargs``. Call before ``train()``. Changes the math against
    ``optim="adamw_8bit"`` for the embedding only: its AdamW state is 8-bit (blockwise quantised) too.

    Raises:
        ValueError: when the trainer's ``optim`` is not an 8-bit bitsandbytes AdamW.
        ImportError: when bitsandbytes is not installed.
    """
    from rapidfire_hf.utils.imports import require

    require("bitsandbytes", "memory.lowmem='on_8bit_embedding' (8-bit AdamW state; needs a GPU)")
    from bitsandbytes.optim import AdamW8bit

    _, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    if kwargs.get("optim_bits") != 8:
        raise ValueError(f"use_8bit_embedding_state expects optim='adamw_8bit', got {trainer.args.optim!r}")
    accepted = inspect.signature(AdamW8bit.__init__).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted and k != "optim_bits"}
    trainer.optimizer_cls_and_kwargs = (AdamW8bit, kwargs)
    return {"optimizer_cls": "bitsandbytes.optim.AdamW8bit", "kwargs": repr(kwargs)}


def eight_bit_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps its state in 8 bits: a bitsandbytes optimizer built with ``optim_bits=8``
    (``AdamW8bit``, ``PagedAdamW8bit``, ...). Read by type and setting, never by class name: bitsandbytes'
    32-bit ``AdamW`` shares the base class. Without bitsandbytes imported no optimizer can be one."""
    bnb = sys.modules.get("bitsandbytes.optim.optimizer")
    if bnb is None or not isinstance(optimizer, (bnb.Optimizer1State, bnb.Optimizer2State)):
        return False
    return optimizer.args.optim_bits == 8
