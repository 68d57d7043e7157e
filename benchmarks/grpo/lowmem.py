"""The low-memory mechanisms of the ``rapidfire_lowmem2..4`` variants, now in the library.

They moved to ``rapidfire_hf.integrations.lowmem`` (behaviour unchanged), where ``enable_rapidfire``
applies them with ``config={"memory": {"lowmem": "on"}}`` (``rapidfire_lowmem4`` runs that way). This
module re-exports them under their old names for ``run.py``'s older variants (``rapidfire_lowmem2``,
``rapidfire_lowmem3``, which still wire them in here) and ``memory_model.py``.
"""

from __future__ import annotations

from rapidfire_hf.integrations.lowmem import (  # noqa: F401
    GIB,
    HostOffloader,
    OffloadStats,
    OptimizerStateOffload,
    _wrap,
    apply_chunked_checkpointing,
    chunk_prefill,
    clear_cublas_workspaces,
    decoder_layers,
    skip_bitsandbytes_sync_on_default_stream,
)
