"""rapidfire/* metrics reach W&B (offline run files) and TensorBoard (event files) through report_to."""

from __future__ import annotations

import json
import struct
import sys
import time

import pytest
from rf_trainers import PARITY_CONFIG, train_log

from rapidfire_hf.integrations import RapidFireWandbCallback, WandbLogger, enable_rapidfire

STEPS = 3
# what every training log carries on a CPU run (CUDA adds allocated/reserved/fragmentation, known GPUs mfu)
HEADLINE = [
    "rapidfire/tokens_per_sec",
    "rapidfire/step_time_s",
    "rapidfire/memory/rss_gib",
    "rapidfire/memory/compactions",
    "rapidfire/optim/rollbacks",
    "rapidfire/optim/skipped",
    "rapidfire/precision/switches",
    "rapidfire/optim/hook_seconds",
]


def read_wandb_history(run_dir, timeout: float = 30.0) -> list[dict]:
    """History rows of a finished offline run, read from its ``run-*.wandb`` file.

    ``wandb.finish()`` can return before wandb-core has written the last records, so this waits for the
    run's ``exit`` record.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = _wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.item} for h in history]


def _wandb_records(run_dir) -> list:
    """The ``wandb_internal_pb2.Record`` protobufs of a run file.

    The file is a LevelDB-style log (``:W&B`` header of 7 bytes, 32 KiB blocks of records with a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST). wandb >= 0.20 no longer ships a Python
    reader, and offline runs write no summary file.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.fixture()
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    wandb.finish()
    wandb.teardown()  # wandb keeps its first settings (WANDB_DIR) per process until torn down


def _runs(tmp_path):
    return sorted((tmp_path / "wandb").glob("offline-run-*"))


def test_wandb_offline_run_holds_rapidfire_metrics(build, wandb_offline):
    import wandb

    trainer = enable_rapidfire(build("sft", max_steps=STEPS, report_to=["wandb"]), config=PARITY_CONFIG)
    trainer.train()
    wandb.finish()  # transformers' reporter leaves the run open; finishing flushes the file
    (run_dir,) = _runs(wandb_offline)
    rows = [r for r in read_wandb_history(run_dir) if "train/loss" in r]
    assert [r["train/global_step"] for r in rows] == list(range(1, STEPS + 1))
    for row, logged in zip(rows, [h for h in trainer.state.log_history if "loss" in h], strict=True):
        for key in HEADLINE:
            # transformers' W&B reporter puts training keys under train/
            assert row[f"train/{key}"] == pytest.approx(logged[key]), key
        assert row["train/rapidfire/tokens_per_sec"] > 0
        assert row["train/rapidfire/optim/steps"] == row["train/global_step"]


def test_tensorboard_receives_rapidfire_metrics(build, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # transformers 5 has no args.logging_dir
    trainer = build("sft", max_steps=STEPS, report_to=["tensorboard"])
    enable_rapidfire(trainer, config=PARITY_CONFIG)
    trainer.train()
    (events,) = [p.parent for p in logdir.rglob("events.out.tfevents.*")]
    acc = EventAccumulator(str(events))
    acc.Reload()
    for key in HEADLINE:
        scalars = acc.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == list(range(1, STEPS + 1)), key
        assert [s.value for s in scalars] == pytest.approx(train_log(trainer, key), rel=1e-6), key


def test_mfu_is_six_n_tokens_over_peak(build):
    trainer = enable_rapidfire(build("sft", max_steps=2), config=PARITY_CONFIG, peak_flops=1e12)
    trainer.train()
    n = trainer.model.num_parameters(exclude_embeddings=True)
    for tps, mfu in zip(train_log(trainer, "rapidfire/tokens_per_sec"), train_log(trainer, "rapidfire/mfu")):
        assert mfu == pytest.approx(6 * n * tps / 1e12)


def test_direct_wandb_callback_when_trainer_does_not_report_to_wandb(build, wandb_offline):
    config = {**PARITY_CONFIG, "logging": {"report_to": ["wandb"]}}
    trainer = enable_rapidfire(build("sft", max_steps=STEPS, report_to=[]), config=config)
    assert isinstance(trainer._rapidfire.parts["metrics"], RapidFireWandbCallback)
    trainer.train()  # the callback started the run and finishes it at train end
    (run_dir,) = _runs(wandb_offline)
    rows = [r for r in read_wandb_history(run_dir) if "train/rapidfire/tokens_per_sec" in r]
    assert [r["train/global_step"] for r in rows] == list(range(1, STEPS + 1))
    assert "train/loss" not in rows[0]  # only ours: the trainer itself reports nowhere


def test_wandb_logger_for_own_trainers(wandb_offline):
    logger = WandbLogger(project="ppo", config={"lr": 1e-6})
    for step in range(3):
        logger.log({"ppo/loss": 0.5 - step * 0.1, "rapidfire/tokens_per_sec": 100.0 * step}, step=step)
    logger.close()
    (run_dir,) = _runs(wandb_offline)
    rows = read_wandb_history(run_dir)
    assert [r["rapidfire/tokens_per_sec"] for r in rows] == [0.0, 100.0, 200.0]


def test_missing_wandb_names_the_extra(monkeypatch):
    from rapidfire_hf.utils import imports

    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb imports
    imports.is_available.cache_clear()
    monkeypatch.setattr(imports, "is_available", lambda name: name != "wandb")
    with pytest.raises(ImportError, match=r"pip install 'rapidfire_hf\[wandb\]'"):
        WandbLogger()


def test_each_counter_is_logged_under_one_name(build):
    trainer = enable_rapidfire(build("sft", max_steps=2), config=PARITY_CONFIG)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][-1]
    names = [k for k in logged if k.startswith("rapidfire/")]
    assert "rapidfire/optim/rollbacks" in names
    short = {"rapidfire/" + k.rsplit("/", 1)[-1] for k in names if k.count("/") > 1}
    assert not short & set(names), f"counters logged twice: {sorted(short & set(names))}"
