"""Turn on the caching allocator's ``expandable_segments`` unless the user configured the allocator.

With expandable segments the allocator grows one virtual segment per stream instead of carving
fixed-size segments, so memory freed by a long sequence can be reused by a short one (and the other
way round): the fragmentation that changing RLHF sequence lengths cause mostly disappears.

torch reads ``PYTORCH_ALLOC_CONF`` first and falls back to the older ``PYTORCH_CUDA_ALLOC_CONF`` (both
names are in ``libc10`` of torch 2.11 and 2.13; ``torch.utils.collect_env`` lists both). The variable is
read when the allocator is first configured, so setting it only works before CUDA initialises; after
that, torch's runtime setter changes the option for segments created from then on.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ALLOC_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


_RUNTIME_EXPANDABLE = False  # set_allocator turned expandable segments on after CUDA initialised


def expandable_segments_active() -> bool:
    """Whether the allocator configuration (environment, or our run-time switch) asks for expandable
    segments."""
    if _RUNTIME_EXPANDABLE:
        return True
    conf = user_allocator_config()
    return conf is not None and "expandable_segments:true" in conf[1].replace(" ", "").lower()


def user_allocator_config() -> tuple[str, str] | None:
    """The ``(variable, value)`` of an allocator configuration already set in the environment, if any."""
    for name in ALLOC_ENV_VARS:
        value = os.environ.get(name)
        if value:
            return name, value
    return None


def _set_at_runtime(setting: str) -> bool:
    # torch >= 2.9 has the device-generic setter; older builds only the (now deprecated) CUDA one.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:
        return False
    setter(setting)
    return True


def setup_allocator(expandable_segments: bool = True) -> str:
    """Configure the CUDA caching allocator for training with changing sequence lengths.

    Args:
        expandable_segments: Set ``False`` to leave the allocator as torch configures it.

    Returns:
        What was done: ``"user"`` (the user set the allocator: left alone), ``"env"`` (variable set
        before CUDA initialised), ``"runtime"`` (CUDA was already initialised: set for new segments only),
        ``"off"`` or ``"no-cuda"``.
    """
    if not expandable_segments:
        return "off"
    user = user_allocator_config()
    if user is not None:
        logger.info("rapidfire: allocator configured by %s=%s; leaving it as is", *user)
        return "user"
    if not torch.cuda.is_available():
        return "no-cuda"
    if not torch.cuda.is_initialized():
        # Both names: child processes built with an older torch read only the CUDA-specific one.
        os.environ["PYTORCH_ALLOC_CONF"] = EXPANDABLE
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
        return "env"
    if _set_at_runtime(EXPANDABLE):
        global _RUNTIME_EXPANDABLE
        _RUNTIME_EXPANDABLE = True
        logger.warning(
            "rapidfire: CUDA was already initialised, so expandable_segments applies only to memory "
            "reserved from now on. Create MemoryCompactionCallback (or call setup_allocator) before the "
            "model is moved to the GPU to cover all of it."
        )
        return "runtime"
    logger.warning(
        "rapidfire: CUDA already initialised and this torch cannot change the allocator at run time"
    )
    return "off"
