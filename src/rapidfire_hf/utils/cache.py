"""Where rapidfire keeps per-user files (the process registry, telemetry without an output dir)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$RAPIDFIRE_CACHE_DIR`` or ``~/.cache/rapidfire``."""
    return Path(os.environ.get("RAPIDFIRE_CACHE_DIR") or Path.home() / ".cache" / "rapidfire")
