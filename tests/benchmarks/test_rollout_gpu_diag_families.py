"""benchmarks/rollout/gpu_diag_families.py (issue 45's GPU diagnosis) runs on the CPU: one line per variant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout"
pytestmark = pytest.mark.usefixtures("single_thread")


def test_every_variant_prints_its_line(capsys):
    sys.path.insert(0, str(SCRIPT_DIR))
    try:
        import gpu_diag_families
    finally:
        sys.path.remove(str(SCRIPT_DIR))
    gpu_diag_families.main(["--device", "cpu", "--tokens", "4"])
    lines = capsys.readouterr().out.splitlines()
    for tf32 in ("off", "on"):
        # eager applies the cap: the engine equals it; sdpa either drops the cap (transformers 5.17) or is refused
        assert f"gemma2 fp32 tf32={tf32} reference attention=eager: equal" in lines
        assert any(line.startswith(f"gemma2 fp32 tf32={tf32} reference attention=sdpa: ") for line in lines)
        assert f"mixtral fp32 tf32={tf32} reference attention=sdpa: equal" in lines
    for name in ("gemma2", "mixtral"):
        assert any(line.startswith(f"{name} bf16: 0 misses, ") for line in lines)
