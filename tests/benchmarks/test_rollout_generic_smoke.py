"""benchmarks/rollout/run.py's generic systems (the model's own forward over the engine's cache) on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout"
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.slow  # ~35 s on the shared CPU: two correctness sections (native and generic) and matplotlib
def test_generic_systems_smoke(tmp_path):
    sys.path.insert(0, str(SCRIPT_DIR))
    try:
        import _timing
        from run import build_model, main
    finally:
        sys.path.remove(str(SCRIPT_DIR))
    argv = [
        "--out",
        str(tmp_path),
        "--smoke",
        "--batches",
        "2",
        "--systems",
        "generic_eager,hf_dynamic,generic_compile",
    ]
    assert main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    generic = result["correctness_generic_fp32"]
    assert generic["decode_path"] == "generic" and result["correctness_fp32"]["decode_path"] == "native"
    assert generic["greedy_token_match_rate"] == 1.0 and generic["logprob_vs_fresh_forward_max_abs"] < 1e-5
    rows = {r["system"]: r for r in result["results"]}
    assert rows["generic_eager"]["status"] == "ok" and rows["generic_eager"]["ms_per_step"] > 0
    assert rows["hf_dynamic"]["status"] == "ok"
    assert rows["generic_compile"]["status"] == "skipped: needs CUDA"
    import torch

    ids = torch.randint(3, 100, (2, 4))
    run = _timing._runner(
        build_model("smoke", "cpu", torch.float32, 64), "generic_eager", ids, torch.ones_like(ids)
    )
    assert run.engine.path == "generic" and run.engine.path_reason == "decode_path='generic'"
