"""`rapidfire monitor` against a real child process that writes telemetry through the library's API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rapidfire_hf.cli.main import main

CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from rapidfire_hf.memory import TelemetryWriter, sample_memory

    # the API a trainer uses, without importing transformers (keeps the child's start short)
    telemetry = TelemetryWriter(sys.argv[1])
    telemetry.open()
    telemetry.memory(sample_memory(torch.nn.Linear(16, 16)), step=3, phase="train", where="step_end")
    telemetry.event("compaction", step=3, reason="phase rollout->train", bytes_returned=0)
    telemetry.event("rollback", step=3, reason="loss spike")
    telemetry.event("precision_switch", step=3, layer="lm_head", to="fp32")
    telemetry.metrics(3, {"tokens_per_s": 1480.0, "loss": 0.5})
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
    """
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("rapidfire_cache")


@pytest.fixture(autouse=True)
def isolated_cache(cache, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(cache))


def start_child(cache, seconds: float) -> subprocess.Popen:
    """A process that registers a telemetry stream, writes a few records, then lives ``seconds``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cache / "telemetry"), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAPIDFIRE_CACHE_DIR": str(cache)},
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture(scope="module")
def live_child(cache):
    proc = start_child(cache, 120)
    yield proc
    proc.kill()
    proc.wait()


def test_once_json_reads_the_live_process(live_child, capsys):
    proc = live_child
    assert main(["monitor", "--pid", str(proc.pid), "--once", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["pid"] == proc.pid and view["step"] == 3 and view["phase"] == "train"
    assert view["device"] == "cpu" and view["memory"]["reserved"] is None and view["nvml"] is None
    assert view["memory"]["rss_bytes"] > 0 and view["holdings"]["parameters"] == (16 * 16 + 16) * 4
    assert (
        view["compactions"]["count"] == 1 and view["compactions"]["last"]["reason"] == "phase rollout->train"
    )
    assert view["rollbacks"] == 1 and view["precision_switches"] == 1 and view["tokens_per_s"] == 1480.0


def test_once_table(live_child, capsys):
    proc = live_child
    assert main(["monitor", "--pid", str(proc.pid), "--once"]) == 0
    out = capsys.readouterr().out
    assert f"rapidfire pid {proc.pid}" in out and "1,480" in out and "compactions" in out


def test_process_ending_while_watched(cache, capsys):
    proc = start_child(cache, 1.0)
    try:
        assert main(["monitor", "--pid", str(proc.pid), "--interval", "0.2", "--json"]) == 5
    finally:
        proc.kill()
        proc.wait()
    captured = capsys.readouterr()
    assert f"process {proc.pid} ended" in captured.err
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["step"] == 3


def test_pid_that_does_not_exist(capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert main(["monitor", "--pid", str(gone.pid), "--once"]) == 3
    assert f"no process with PID {gone.pid}" in capsys.readouterr().err


def test_process_that_is_not_rapidfire(capsys):
    assert main(["monitor", "--pid", str(os.getpid()), "--once"]) == 4
    assert "is not a rapidfire training process" in capsys.readouterr().err


GPU_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from rapidfire_hf.memory import TelemetryWriter, sample_memory

    telemetry = TelemetryWriter(sys.argv[1])
    telemetry.open()
    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    telemetry.memory(sample_memory(), step=1, phase="train", where="step_end")
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.gpu
def test_once_json_on_gpu_has_allocator_and_nvml_memory(cache, capsys):
    from rapidfire_hf.utils.imports import is_available

    proc = subprocess.Popen(
        [sys.executable, "-c", GPU_CHILD, str(cache / "gpu-telemetry")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAPIDFIRE_CACHE_DIR": str(cache)},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert main(["monitor", "--pid", str(proc.pid), "--once", "--json"]) == 0
        view = json.loads(capsys.readouterr().out)
        assert view["device"].startswith("cuda") and view["memory"]["allocated"] >= 256 << 20
        assert view["memory"]["reserved"] >= view["memory"]["allocated"]
        if is_available("pynvml"):
            assert view["nvml"] and view["nvml"][0]["used_bytes"] >= 256 << 20
    finally:
        proc.kill()
        proc.wait()


# ---- bad arguments, hostile or broken streams
@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--interval", "0", "seconds >= 0.1"),
        ("--interval", "0.01", "seconds >= 0.1"),
        ("--interval", "-1", "seconds >= 0.1"),
        ("--interval", "nan", "finite"),
        ("--interval", "inf", "finite"),
        ("--interval", "soon", "not a number of seconds"),
        ("--pid", "-5", "positive integer"),
        ("--pid", "0", "positive integer"),
        ("--pid", "abc", "not a process id"),
    ],
)
def test_bad_arguments_are_refused_by_argparse(flag, value, says, capsys):
    argv = ["monitor", "--pid", "1", "--once", flag, value]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and says in err and "Traceback" not in err


ESC = "\x1b"
HOSTILE_LINES = [
    {"kind": "meta", "t": 1.0, "pid": 1, "host": f"box{ESC}]0;owned{chr(7)}{ESC}[2J[bold red]pwn[/]"},
    {"kind": "memory", "t": 2.0, "step": 4, "phase": f"train{ESC}[31m\u202e", "device": "cpu"}
    | {"rss_bytes": "lots", "holdings": {f"params{ESC}[5m": 1024}},
    {"kind": "event", "t": 3.0, "name": {"not": "a name"}},
    {"kind": "event", "t": "yesterday", "name": "rollback"},
    {"kind": "metrics", "t": 4.0, "step": 4, "values": "fast"},
    {"kind": "metrics", "t": 5.0, "step": 5, "values": {"tokens_per_s": "many", "loss": f"{ESC}[1m0.5"}},
    {"kind": "event", "t": 6.0, "name": "compaction", "bytes_returned": [1]},
    [1, 2],
    42,
    None,
    "just a string",
]


@pytest.fixture()
def own_entry(tmp_path, monkeypatch):
    """Register this test process with a stream the test writes (a fresh cache per test)."""
    from rapidfire_hf.memory.telemetry import registry_path

    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path / "cache"))
    stream = tmp_path / "stream.jsonl"
    entry = registry_path(os.getpid())
    entry.parent.mkdir(parents=True)
    entry.write_text(json.dumps({"pid": os.getpid(), "create_time": None, "stream": str(stream)}))
    return entry, stream


@pytest.mark.parametrize("as_json", [False, True])
def test_hostile_stream_is_sanitised_and_malformed_records_skipped(own_entry, capsys, as_json):
    _, stream = own_entry
    lines = [json.dumps(r) for r in HOSTILE_LINES] + ["{not json", '{"kind": "event", "t": 7.0, "na']
    stream.write_text("\n".join(lines))
    assert main(["monitor", "--pid", str(os.getpid()), "--once"] + (["--json"] if as_json else [])) == 0
    out = capsys.readouterr()
    assert ESC not in out.out and chr(7) not in out.out and "\u202e" not in out.out
    assert "Traceback" not in out.err
    if as_json:
        view = json.loads(out.out)
        assert view["step"] == 5 and view["phase"] == "train[31m" and view["rollbacks"] == 0
        assert view["metrics"]["loss"] == "[1m0.5" and view["host"].startswith("box]0;owned")
    else:
        assert "[bold red]pwn[/]" in out.out.replace("\n", "")  # shown as text, not as rich markup
        assert "train[31m" in out.out and "many" in out.out


@pytest.mark.parametrize("entry_text", ["[]", '{"pid": 1}', '"x"', "{broken"])
def test_malformed_registry_entry_gives_a_message(own_entry, capsys, entry_text):
    entry, _ = own_entry
    entry.write_text(entry_text)
    assert main(["monitor", "--pid", str(os.getpid()), "--once"]) == 4
    err = capsys.readouterr().err
    assert "telemetry entry" in err and "Traceback" not in err


def test_stream_deleted_while_watched(own_entry, capsys):
    _, stream = own_entry
    stream.write_text(json.dumps({"kind": "metrics", "t": 1.0, "step": 1, "values": {"loss": 0.5}}) + "\n")
    result = {}
    watcher = threading.Thread(
        target=lambda: result.update(
            rc=main(["monitor", "--pid", str(os.getpid()), "--interval", "0.1", "--json"])
        )
    )
    watcher.start()
    time.sleep(0.5)
    stream.unlink()
    watcher.join(timeout=20)
    assert not watcher.is_alive() and result["rc"] == 6
    err = capsys.readouterr().err
    assert "cannot read the telemetry stream" in err and "deleted" in err and "Traceback" not in err
