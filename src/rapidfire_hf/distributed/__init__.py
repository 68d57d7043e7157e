"""rapidfire_hf across processes: which features hold per engine, and cross-rank sync checks.

``describe_engine(accelerator)`` says what DDP, DeepSpeed ZeRO-2/3 and FSDP2 keep of rapidfire_hf;
``RAPIDFIRE_SYNC_DEBUG=1`` with :func:`attach_sync_debug` (or :class:`SyncChecker` in a plain loop)
compares parameter and gradient checksums across ranks every ``gradient.sync_interval`` steps.
"""

from rapidfire_hf.distributed.features import (
    FEATURES,
    Engine,
    EngineSupport,
    Status,
    describe_engine,
    detect_engine,
    support_for,
)
from rapidfire_hf.distributed.generation import gathered_for_generation
from rapidfire_hf.distributed.sync_debug import (
    SyncChecker,
    SyncDebugCallback,
    SyncReport,
    attach_sync_debug,
    check_sync,
    sync_debug_enabled,
)

__all__ = [
    "FEATURES",
    "Engine",
    "EngineSupport",
    "Status",
    "SyncChecker",
    "SyncDebugCallback",
    "SyncReport",
    "attach_sync_debug",
    "check_sync",
    "describe_engine",
    "detect_engine",
    "gathered_for_generation",
    "support_for",
    "sync_debug_enabled",
]
