"""``benchmarks/distributed/largest_model.sh --smoke`` and the rows ppo_throughput.py writes when a run
fails: the GPU script's CPU path (2 gloo processes and 1 process, the smoke shape, separate and fused
value, both optimizers) runs end to end and its report reads what the runs wrote; SET=bf16's pure-bf16
pair (FSDP2 x2 on the CPU and one process) and the report's comparison of one model across engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.benchmarks.loader import load_benchmark

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


@pytest.mark.slow  # 23 s on a 2-core CPU
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


@pytest.mark.slow  # 8 s on a 2-core CPU
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


@pytest.mark.slow  # ~50 s: three child processes (2 FSDP2 ranks, 1 single) importing torch and transformers
def test_pure_bf16_fsdp2_on_cpu_matches_one_process_and_is_compared(tmp_path):
    """SET=bf16's pair on the CPU: FSDP2 x2 through accelerate's real engine (--cpu-fsdp2) and one
    process, both pure bf16 (weights, fused value head, gradients, AdamW moments: FSDP2 needs one dtype
    per group, so an fp32 value head would fail its first forward); the report pairs the two runs."""
    ppo, size = str(BENCH / "ppo_throughput.py"), ["--tiny", "--reward", "rule", "--per-device-batch", "2"]
    size += ["--accumulation", "1", "--prompt-length", "8", "--response-length", "4", "--updates", "1"]
    size += ["--rollout-backend", "hf", "--max-oom-splits", "0", "--value-mode", "fused"]
    size += ["--precision", "bf16", "--optimizer", "adamw"]
    launch = ["accelerate", "launch", "--mixed_precision", "no", "--main_process_port", "29867"]
    launch += ["--config_file", str(ROOT / "accelerate_configs/fsdp2.yaml"), ppo]
    cmds = {
        "fsdp2_fused_bf16": launch + size + ["--cpu-fsdp2"],
        "single_fused_bf16": [sys.executable, ppo] + size,
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    procs = {
        k: subprocess.Popen(
            c + ["--out", str(tmp_path / f"{k}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, c in cmds.items()
    }
    for name, p in procs.items():
        output = p.communicate(timeout=200)[0]
        assert p.returncode == 0, f"{name}: {output[-3000:]}"
    (tmp_path / "steps.jsonl").write_text(
        "".join(json.dumps({"name": k, "rc": 0, "seconds": 1}) + "\n" for k in cmds)
    )
    report = _load("largest_report")
    results = report.collect(tmp_path)
    fsdp2, single = results["runs"]
    assert (fsdp2["status"], fsdp2["engine"], fsdp2["processes"]) == ("ok", "fsdp2", 2)
    assert (single["status"], single["engine"], single["processes"]) == ("ok", "single", 1)
    for row in (fsdp2, single):
        assert row["precision"] == "bf16" and row["updates"] == 1
        assert row["param_dtypes"] == row["optimizer_state_dtypes"] == ["bfloat16"]
    assert fsdp2["trainable_params"] == single["trainable_params"]  # DTensor numel: the global size
    assert fsdp2["label"] == "FSDP2 x2 (CPU), fused bf16" and single["label"] == "1 proc, fused bf16"
    assert results["comparisons"] == ["smoke fused bf16: trains on FSDP2 x2 (CPU); trains on 1 proc"]


def test_report_compares_one_model_across_engines():
    """An OOM on one GPU beside a run that trains on two: the line the SET=bf16 call is for."""
    report = _load("largest_report")
    base = {"model": "llama-15b", "value_mode": "fused", "precision": "bf16"}
    rows = [
        {**base, "label": "FSDP2 x2, fused 15b", "status": "ok", "max_peak_gib": 101.25},
        {**base, "label": "1 GPU, fused 15b", "status": "oom", "failed_phase": "train", "failed_update": 1},
        {**base, "model": "llama-7b", "label": "1 GPU, fused 7b", "status": "ok", "max_peak_gib": 75.0},
        {**base, "label": "ZeRO-3 x2, fused 15b", "status": "skipped"},
    ]
    assert report.comparisons(rows) == [
        "llama-15b fused bf16: trains on FSDP2 x2 (101.2 GiB/GPU); out of memory on 1 GPU (train, update 1)"
    ]


def test_precision_options(monkeypatch):
    pt = _load("ppo_throughput")
    auto, pure = pt.parse_args(["--out", "x.json"]), pt.parse_args(["--out", "x.json", "--precision", "bf16"])
    assert pt.precision_of(auto, cuda=True) == (torch.bfloat16, "bf16-mixed")
    assert pt.precision_of(auto, cuda=False) == (torch.float32, "fp32")
    assert pt.precision_of(pure, cuda=False) == pt.precision_of(pure, cuda=True) == (torch.bfloat16, "bf16")
    with pt.default_dtype(torch.bfloat16):
        assert torch.nn.Linear(2, 1).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(SystemExit):
        pt.parse_args(["--out", "x.json", "--cpu-fsdp2"])  # a CPU smoke option: needs --tiny
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ValueError, match="fsdp2.yaml"):
        pt.fsdp2_on_cpu()
