"""The telemetry stream: buffering before open, registry by PID, tailing and summarising."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import torch

from rapidfire_hf.memory.stats import sample_memory
from rapidfire_hf.memory.summary import TelemetrySummary, TelemetryTail, locate_stream
from rapidfire_hf.memory.telemetry import TelemetryPathError, TelemetryWriter, registry_path
from tests.helpers import faults_io


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_before_open_are_written_after_meta(tmp_path):
    w = TelemetryWriter(tmp_path / "run")
    w.event("precision_switch", step=0, layer="lm_head", to="fp32")
    assert not w.is_open
    path = w.open()
    w.metrics(1, {"tokens_per_s": 1234.5, "loss": torch.tensor(0.25)})
    w.close()
    recs = read_lines(path)
    assert [r["kind"] for r in recs] == ["meta", "event", "metrics"]
    assert recs[0]["pid"] == os.getpid()
    assert recs[1]["name"] == "precision_switch" and recs[1]["layer"] == "lm_head"
    assert recs[2]["values"] == {"tokens_per_s": 1234.5, "loss": 0.25}  # tensor stored as a number


def test_registry_entry_points_at_stream_and_goes_away_on_close(tmp_path):
    w = TelemetryWriter(tmp_path / "run")
    path = w.open()
    entry = json.loads(registry_path(os.getpid()).read_text())
    assert entry["stream"] == str(path.resolve()) and entry["pid"] == os.getpid()
    assert locate_stream(os.getpid())[0] == path.resolve()
    w.close()
    assert not registry_path(os.getpid()).exists() and path.exists()


def test_stale_registry_entries_are_removed(tmp_path, isolated_cache):
    procs = isolated_cache / "procs"
    procs.mkdir(parents=True)
    stale = procs / "999999999.json"  # above any pid_max: never a live process
    stale.write_text(json.dumps({"pid": 999999999, "create_time": 1.0, "stream": "/nowhere"}))
    w = TelemetryWriter(tmp_path / "run")
    w.open()
    w.close()
    assert not stale.exists()


def test_tail_returns_only_new_complete_lines(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"kind": "meta", "t": 1, "pid": 7}\n{"kind": "event", "t": 2, "na')
    tail = TelemetryTail(path)
    assert [r["kind"] for r in tail.read_new()] == ["meta"]
    with open(path, "a") as f:
        f.write('me": "rollback", "step": 4}\nnot json\n')
    assert tail.read_new() == [{"kind": "event", "t": 2, "name": "rollback", "step": 4}]
    assert tail.read_new() == []


def test_summary_counts_events_and_keeps_latest_memory(tmp_path):
    w = TelemetryWriter(tmp_path / "run", register=False)
    path = w.open()
    w.memory(sample_memory(torch.nn.Linear(2, 2)), step=1, phase="train", where="step_end")
    for step, returned in ((2, 100), (5, 50)):
        w.event("compaction", step=step, bytes_returned=returned)
    w.event("rollback", step=5)
    w.metrics(5, {"tokens_per_s": 99.0})
    w.close()
    s = TelemetrySummary()
    s.update(TelemetryTail(path).read_new())
    view = s.to_dict()
    assert view["compactions"]["count"] == 2 and view["compactions"]["bytes_returned"] == 150
    assert view["rollbacks"] == 1 and view["precision_switches"] == 0
    assert view["tokens_per_s"] == 99.0 and view["step"] == 5 and view["phase"] == "train"
    assert view["device"] == "cpu" and view["holdings"]["parameters"] == 24
    assert view["memory"]["rss_bytes"] > 0 and view["memory"]["reserved"] is None


# ---- files are private and never reached through a planted link (helpers in tests/helpers/faults_io.py)
def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_stream_and_registry_are_private(tmp_path, isolated_cache):
    w = TelemetryWriter(tmp_path / "run")
    path = w.open()
    entry = registry_path(os.getpid())
    assert _mode(path) == 0o600 and _mode(entry) == 0o600
    assert _mode(tmp_path / "run") == 0o700 and _mode(isolated_cache / "procs") == 0o700
    w.close()


def test_symlink_planted_as_registry_tmp_is_not_followed(tmp_path, isolated_cache):
    victim = tmp_path / "victim.txt"
    victim.write_text("root-owned content")
    faults_io.plant_symlink(isolated_cache / "procs" / f"{os.getpid()}.tmp", victim)
    w = TelemetryWriter(tmp_path / "run")
    path = w.open()
    assert victim.read_text() == "root-owned content"
    entry = registry_path(os.getpid())
    assert not entry.is_symlink() and json.loads(entry.read_text())["stream"] == str(path.resolve())
    w.close()


def test_symlink_planted_as_stream_is_refused(tmp_path):
    run = tmp_path / "run"
    victim = tmp_path / "victim.txt"
    victim.write_text("root-owned content")
    faults_io.plant_symlink(run / f"{socket.gethostname()}-{os.getpid()}.jsonl", victim)
    with pytest.raises(TelemetryPathError, match="symlink"):
        TelemetryWriter(run).open()
    assert victim.read_text() == "root-owned content"


def test_hard_link_planted_as_stream_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("root-owned content")
    os.link(victim, run / f"{socket.gethostname()}-{os.getpid()}.jsonl")
    with pytest.raises(TelemetryPathError, match="single link"):
        TelemetryWriter(run).open()
    assert victim.read_text() == "root-owned content"


def test_symlinked_registry_folder_is_refused(tmp_path, isolated_cache):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    isolated_cache.mkdir(parents=True)
    faults_io.plant_symlink(isolated_cache / "procs", elsewhere)
    w = TelemetryWriter(tmp_path / "run")
    with pytest.raises(TelemetryPathError, match="procs"):
        w.open()
    assert list(elsewhere.iterdir()) == []
    w.close()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_folder_of_another_user_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chown(run, 4321, 4321)
    with pytest.raises(TelemetryPathError, match="belongs to uid 4321"):
        TelemetryWriter(run).open()
    assert list(run.iterdir()) == []
