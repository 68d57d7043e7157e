"""Run a script of ``tests/distributed/scripts`` on 2 CPU processes with torchrun (gloo backend).

``accelerate launch --cpu --num_processes 2`` starts a single process in accelerate 1.15 (its
multi-CPU path needs MPI), so the CPU tests use torchrun, which accelerate detects as MULTI_CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def run_ranks(script: str, out: Path, *args: str, nproc: int = 2, timeout: int = 150) -> None:
    """Run ``script`` on ``nproc`` processes; raise with the output tail when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(SCRIPTS / script),
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{tail}")


def assert_greedy_rollout_equal(r: dict, rank: int) -> None:
    """What every sharded-rollout rank script reports (``scripts/rollout_check.py``): the engine ran native,
    and the greedy tokens of the sharded trainer's rollout equal the unsharded policy's (``model.generate``
    and the static engine, one process) and a second rollout's (weights gathered again)."""
    assert (r["backend"], r["path"]) == ("static", "native"), rank
    assert r["tokens"] > 2 * r["rows"]
    assert r["equal_generate"], f"rank {rank}: tokens differ from the unsharded model.generate"
    assert r["equal_engine"], f"rank {rank}: tokens differ from the unsharded static engine"
    assert r["equal_first"], f"rank {rank}: a second rollout (weights gathered again) differs"
