"""Memory management: compaction callback, telemetry, OOM recovery, selective and chunked offloaded
checkpointing, host offload of optimizer state, prefetch.

See docs/architecture.md ("The parts"). Nothing here imports other rapidfire_hf parts except ``utils``;
configuration arrives duck-typed (anything with ``compaction_threshold``, ``optimization``,
``prefetch_window``). Names are imported lazily so that ``rapidfire monitor`` does not pay for
importing transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> private module that defines it
_EXPORTS = {
    "setup_allocator": "allocator",
    "MemoryCompactionCallback": "callback",
    "ChunkedCheckpoint": "chunked_checkpoint",
    "apply_chunked_checkpointing": "chunked_checkpoint",
    "checkpoint_module_in_chunks": "chunked_checkpoint",
    "decoder_layers": "chunked_checkpoint",
    "activation_bytes": "checkpointing",
    "apply_selective_checkpointing": "checkpointing",
    "auto_checkpointing": "checkpointing",
    "cost_policy": "checkpointing",
    "selective_context_fn": "checkpointing",
    "OOMRecovery": "oom",
    "accelerate_hold": "oom",
    "OOMRecoveryError": "oom",
    "batch_size": "oom",
    "run_in_chunks": "oom",
    "run_with_oom_recovery": "oom",
    "split_batch": "oom",
    "HostOffloader": "offload",
    "OffloadStats": "offload",
    "OptimizerStateOffload": "offload",
    "BatchPrefetcher": "prefetch",
    "MemorySample": "stats",
    "clear_cublas_workspaces": "stats",
    "compaction_reason": "stats",
    "release_cached_memory": "stats",
    "sample_memory": "stats",
    "NoSuchProcessError": "summary",
    "NotRapidfireProcessError": "summary",
    "TelemetrySummary": "summary",
    "TelemetryTail": "summary",
    "locate_stream": "summary",
    "TelemetryWriter": "telemetry",
    "get_telemetry": "telemetry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rapidfire_hf.memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rapidfire_hf.memory.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from rapidfire_hf.memory.allocator import setup_allocator  # noqa: F401
    from rapidfire_hf.memory.callback import MemoryCompactionCallback  # noqa: F401
    from rapidfire_hf.memory.checkpointing import (  # noqa: F401
        activation_bytes,
        apply_selective_checkpointing,
        auto_checkpointing,
        cost_policy,
        selective_context_fn,
    )
    from rapidfire_hf.memory.chunked_checkpoint import (  # noqa: F401
        ChunkedCheckpoint,
        apply_chunked_checkpointing,
        checkpoint_module_in_chunks,
        decoder_layers,
    )
    from rapidfire_hf.memory.offload import HostOffloader, OffloadStats, OptimizerStateOffload  # noqa: F401
    from rapidfire_hf.memory.oom import (  # noqa: F401
        OOMRecovery,
        OOMRecoveryError,
        accelerate_hold,
        batch_size,
        run_in_chunks,
        run_with_oom_recovery,
        split_batch,
    )
    from rapidfire_hf.memory.prefetch import BatchPrefetcher  # noqa: F401
    from rapidfire_hf.memory.stats import (  # noqa: F401
        MemorySample,
        clear_cublas_workspaces,
        compaction_reason,
        release_cached_memory,
        sample_memory,
    )
    from rapidfire_hf.memory.summary import (  # noqa: F401
        NoSuchProcessError,
        NotRapidfireProcessError,
        TelemetrySummary,
        TelemetryTail,
        locate_stream,
    )
    from rapidfire_hf.memory.telemetry import TelemetryWriter, get_telemetry  # noqa: F401
