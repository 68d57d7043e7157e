"""Every ``--json`` command's stdout is exactly its JSON, whatever libraries print while it works.

transformers prints ``[INFO] Running in WANDB offline mode`` on stdout when its integrations are first
imported, bitsandbytes 0.50 printed which CPU kernels it failed to load; both landed in front of
``rapidfire plan --json``'s document. The probe below stands in for such libraries: once the arguments
are parsed (the command at work), every module import prints a line with Python's ``print`` and with C's
``printf``, and the first one also writes to file descriptor 1 and runs a child process that prints, all
on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rapidfire_hf.cli.json_output import JsonStdout

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import ctypes, importlib.abc, json, os, subprocess, sys

class NoisyLibrary(importlib.abc.MetaPathFinder):
    first = True

    def find_spec(self, name, path, target=None):
        print(f"[noise] print while importing {name}")
        ctypes.CDLL(None).printf(b"[noise] C printf\n")  # buffered in C's stdio where stdout is a pipe
        if NoisyLibrary.first:
            NoisyLibrary.first = False
            os.write(1, b"[noise] fd 1\n")
            subprocess.run([sys.executable, "-c", "print('[noise] child process')"], check=True)
        return None

import rapidfire_hf.cli.main as cli_main

build_parser = cli_main.build_parser

def build_parser_then_make_noise():  # the command's work starts once its arguments are parsed
    parser = build_parser()
    sys.meta_path.insert(0, NoisyLibrary())
    return parser

cli_main.build_parser = build_parser_then_make_noise

argv = [str(os.getpid()) if a == "PID" else a for a in sys.argv[1:]]
if "PID" in sys.argv:  # monitor this probe: register it with a stream of one metrics record
    from rapidfire_hf.memory.telemetry import registry_path

    stream = os.path.join(os.environ["RAPIDFIRE_CACHE_DIR"], "stream.jsonl")
    with open(stream, "w") as f:
        f.write(json.dumps({"kind": "metrics", "t": 1.0, "step": 3, "values": {"loss": 0.5}}) + "\n")
    entry = registry_path(os.getpid())
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text(json.dumps({"pid": os.getpid(), "create_time": None, "stream": stream}))
status = cli_main.main(argv)
sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, NoisyLibrary)]  # the work is over
sys.exit(status)  # (torch imports tabulate at exit, which would print here)
"""

COMMANDS = {
    "plan": ["plan", "--shape", "llama-1.1b", "--gpu-memory", "80", "--json"],
    "env": ["env", "--json"],
    "config show": ["config", "show", "--preset", "aggressive", "--format", "json"],
    "monitor": ["monitor", "--pid", "PID", "--once", "--json"],
}


@pytest.mark.slow  # a fresh interpreter importing torch per command
@pytest.mark.parametrize("command", list(COMMANDS))
def test_stdout_is_only_the_json_while_libraries_print(command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # C's stdio buffers, as in a pipe
    env.update(PYTHONPATH=str(ROOT / "src"), RAPIDFIRE_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *COMMANDS[command]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    json.loads(done.stdout)  # the whole of stdout, nothing before or after
    assert "[noise]" not in done.stdout
    for noise in ("print while importing", "fd 1", "C printf", "child process"):  # it did print, on stderr
        assert f"[noise] {noise}" in done.stderr, (noise, done.stderr[-2000:])


def test_emit_restores_stdout_between_documents_and_on_exit(capfd):
    before = sys.stdout
    with JsonStdout() as out:
        print("library chatter")
        os.write(1, b"fd chatter\n")
        out.emit({"n": 1}, indent=None)
        print("more chatter")
        out.emit({"n": 2}, indent=None)
        assert sys.stdout is sys.stderr
    assert sys.stdout is before
    print("after")
    captured = capfd.readouterr()
    assert captured.out.splitlines() == ['{"n": 1}', '{"n": 2}', "after"]
    assert captured.err.splitlines() == ["library chatter", "fd chatter", "more chatter"]


def test_inactive_changes_nothing(capfd):
    with JsonStdout(active=False) as out:
        print("table")
        out.emit([1], indent=None)
    assert capfd.readouterr().out.splitlines() == ["table", "[1]"]
