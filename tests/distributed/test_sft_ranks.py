"""``enable_rapidfire`` on TRL's SFTTrainer over 2 CPU processes (gloo, DDP) against one process with
twice the per-device batch: the same samples per optimizer step, so the same training within fp32
round-off; and identical parameters on both ranks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmarks.loader import load_benchmark
from tests.distributed.launch import SCRIPTS

ROOT = Path(__file__).parents[2]


def _start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, cmd: list[str], timeout: int = 150) -> None:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{out[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    two, one = root / "sft_ddp", root / "sft_single"  # the layout gpu_issue8.sh's report reads
    script = str(SCRIPTS / "sft_ranks.py")
    # fp32 throughout and a static precision plan: the comparison is then at fp32 round-off
    config = '{"gradient": {"pipeline": true}, "precision": {"mode": "static", "initial": "fp32"}}'
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmds = [
        torchrun + [script, str(two), "--batch", "4", "--config", config],
        [sys.executable, script, str(one), "--batch", "8", "--config", config],
    ]
    procs = [_start(c) for c in cmds]  # both at once: most of the time is imports
    for proc, cmd in zip(procs, cmds):
        _finish(proc, cmd)
    ddp = [torch.load(two / f"sft_rank{r}.pt", weights_only=True) for r in range(2)]
    return ddp, torch.load(one / "sft_rank0.pt", weights_only=True), root


@pytest.mark.slow  # 37 s on a 2-core CPU
def test_both_ranks_trained_with_rapidfire_under_ddp(runs):
    ddp, _, _ = runs
    for r, res in enumerate(ddp):
        assert res["status"] == "ok" and res["rank"] == r and res["world_size"] == 2
        assert res["global_step"] == 4 and len(res["losses"]) == 4
        assert all(math.isfinite(x) for x in res["losses"])
        assert res["optimizer"] == "RapidFireOptimizer"
        assert any(s.startswith("RapidFireOptimizer around") for s in res["installed"])
        # every window deferred to step(): the hooks would fire before DDP's all-reduce
        assert res["optimizer_stats"]["steps"] == 4
        assert res["optimizer_stats"]["deferred_steps"] == {"distributed": 4}
        # every window is verified before its update under DDP: no rollback snapshot is ever taken
        assert res["optimizer_stats"]["snapshots"] == 0 and res["optimizer_stats"]["snapshot_bytes"] == 0
    assert "rapidfire/optim/steps" in ddp[0]["rapidfire_logged"]  # the metrics reach the main process's logs
    engine = ddp[0]["engine"]
    assert engine["engine"] == "ddp" and engine["world_size"] == 2
    assert engine["features"]["gradient_pipeline"]["status"] == "falls back"


def test_parameters_identical_across_ranks_and_finite(runs):
    (a, b), _, _ = runs
    assert a["params"].numel() > 50_000 and a["params_finite"] and a["local_params_finite"]
    assert torch.equal(a["params"], b["params"])


def test_two_ranks_match_one_process_with_twice_the_batch(runs):
    (a, _), single, _ = runs
    assert single["world_size"] == 1 and single["engine"]["engine"] == "single"
    moved = (single["params"] - a["params"]).abs().max()
    assert moved < 1e-5, moved
    assert a["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert a["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    assert a["losses"][-1] < a["losses"][0]  # it trained (lr 1e-3, 4 steps)


def test_report_summarises_the_runs(runs):
    report = load_benchmark("distributed/report.py")
    _, _, root = runs
    summary = report.sft_summary(root)["runs"]
    assert set(summary) == {"ddp", "single"}
    ddp = summary["ddp"]
    assert ddp["status"] == "ok" and ddp["finished"] and ddp["engine"] == "ddp" and ddp["world_size"] == 2
    assert ddp["params_finite"] and ddp["params_equal_across_ranks"] and ddp["losses_finite"]
    assert ddp["features"]["rollback"] == "holds" and ddp["optimizer"] == "RapidFireOptimizer"
    assert summary["single"]["engine"] == "single" and summary["single"]["params_equal_across_ranks"] is None
    assert (root / "sft_engines.json").is_file()
