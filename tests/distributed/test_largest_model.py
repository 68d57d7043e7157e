"""``benchmarks/distributed/largest_model.sh --smoke`` and the rows ppo_throughput.py writes when a run
fails: the GPU script's CPU path (2 gloo processes and 1 process, the smoke shape, separate and fused
value, both optimizers) runs end to end and its report reads what the runs wrote."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.bench_loader import load_benchmark

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "benchmarks/distributed"


def _load(name: str):
    return load_benchmark(f"distributed/{name}.py")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("largest")
    proc = subprocess.run(
        ["bash", str(BENCH / "largest_model.sh"), str(out), "--smoke"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "largest_model.json").read_text())


def test_smoke_runs_finish_and_report(smoke):
    out, results = smoke
    runs = {r["name"]: r for r in results["runs"]}
    assert list(runs) == ["ddp2_separate", "single_fused_rapidfire"]
    ddp, fused = runs["ddp2_separate"], runs["single_fused_rapidfire"]
    assert ddp["status"] == "ok" and ddp["rc"] == 0 and ddp["processes"] == 2 and ddp["engine"] == "ddp"
    assert [ddp[k] for k in ("value_mode", "optimizer", "reward", "model")] == [
        "separate",
        "adamw",
        "rule",
        "smoke",
    ]
    assert fused["status"] == "ok" and fused["processes"] == 1 and fused["engine"] == "single"
    assert (fused["value_mode"], fused["optimizer"]) == ("fused", "rapidfire")
    assert ddp["updates"] == fused["updates"] == 2
    assert ddp["tokens_per_second"] > 0 and fused["tokens_per_second"] > 0
    assert ddp["rollout_backend"] == fused["rollout_backend"] == "hf"
    # --shape reached the models: policy + value model of the smoke shape, or policy + a hidden -> 1 head
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rapidfire_hf.demo.shapes import llama_config, llama_shape

    config = llama_config(llama_shape("smoke"), 1024)
    policy = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    value = sum(p.numel() for p in LlamaForSequenceClassification(config).parameters())
    assert ddp["trainable_params"] == policy + value
    assert fused["trainable_params"] == policy + config.hidden_size + 1
    assert len(ddp["peak_gib_per_rank"]) == 2  # one entry per rank (None on CPU)
    assert all(v.endswith("tokens/s") and "trains" in v for v in results["verdicts"])
    assert (out / "largest_model.png").stat().st_size > 1000
    for r in range(2):  # every rank wrote its own row and pid
        row = json.loads((out / "ddp2_separate.ranks" / f"rank{r}.json").read_text())
        assert row["rank"] == r and row["status"] == "ok" and row["update"] == 2 and row["phase"] == "train"
        assert (out / "ddp2_separate.ranks" / f"pid{r}").is_file()


def test_failed_runs_become_rows(tmp_path):
    script = str(BENCH / "ppo_throughput.py")
    cmds = {
        "bad_shape": [sys.executable, script, "--tiny", "--shape", "no-such-shape"],
        "late": [sys.executable, script, "--tiny", "--deadline", "1"],
        "killed": [sys.executable, script, "--tiny", "--updates", "50"],  # SIGKILLed below, mid-update
    }
    procs = {
        k: subprocess.Popen(
            c + ["--out", str(tmp_path / f"{k}.json")],
            stdout=subprocess.PIPE if k != "killed" else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, c in cmds.items()
    }
    killed, row_path = procs.pop("killed"), tmp_path / "killed.ranks" / "rank0.json"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and killed.poll() is None:
        if row_path.exists() and json.loads(row_path.read_text())["phase"] in ("rollout", "score", "train"):
            break
        time.sleep(0.2)
    killed.kill()  # a rank killed without warning leaves the row of the phase it was in
    killed.wait(timeout=30)
    rcs = {}
    for k, p in procs.items():
        output = p.communicate(timeout=120)[0]
        rcs[k] = (p.returncode, output)
    assert rcs["bad_shape"][0] == 1, rcs["bad_shape"][1][-2000:]
    assert rcs["late"][0] == 124, rcs["late"][1][-2000:]
    load_run = _load("ppo_throughput").load_run
    row = load_run(tmp_path / "killed.json")
    assert row["status"] == "killed" and row["failed_phase"] in ("rollout", "score", "train")
    assert row["ranks"][0]["update"] >= 1
    bad = load_run(tmp_path / "bad_shape.json")
    assert bad["status"] == "error" and "unknown shape 'no-such-shape'" in bad["error"]
    assert bad["failed_phase"] == "setup" and "KeyError" in bad["ranks"][0]["traceback"]
    late = load_run(tmp_path / "late.json")
    assert late["status"] == "timeout" and "deadline of 1s" in late["error"]
    assert load_run(tmp_path / "never.json") == {"name": "never", "status": "missing"}


def test_out_of_memory_errors_are_classified():
    pt = _load("ppo_throughput")
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity")
    assert pt.classify(err) == "oom" and pt.requested_gib(str(err)) == pytest.approx(1.5)
    assert pt.requested_gib("Tried to allocate 512.00 MiB") == pytest.approx(0.5)
    assert pt.classify(RuntimeError("DeepSpeed: CUDA error: out of memory")) == "oom"
    assert pt.classify(KeyError("x")) == "error" and pt.requested_gib("no size here") is None
