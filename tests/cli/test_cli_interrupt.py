"""Ctrl-C on any `rapidfire` subcommand: one line on stderr, no traceback, exit status 130 (issue 30)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import pytest
from test_cli_errors import subcommands, watched  # noqa: F401 (watched is a fixture)

from rapidfire_hf.cli import main as cli_main

# a command line each subcommand parses without error (its work is replaced by a Ctrl-C)
VALID = {
    "demo": ["demo"],
    "plan": ["plan"],
    "sweep": ["sweep", "sweep.yaml"],
    "monitor": ["monitor", "--pid", "1"],
    "bench": ["bench", "ppo"],
    "env": ["env"],
    "config": ["config", "presets"],
}


@pytest.fixture()
def interrupted_work(monkeypatch):
    """Every subcommand's function raises KeyboardInterrupt, as Ctrl-C does in the middle of its work."""
    build = cli_main.build_parser

    def interrupt(args):
        raise KeyboardInterrupt

    def parser_with_interrupt() -> argparse.ArgumentParser:
        parser = build()
        parse = parser.parse_args

        def parse_args(argv=None, namespace=None):
            ns = parse(argv, namespace)
            ns.func = interrupt
            return ns

        parser.parse_args = parse_args
        return parser

    monkeypatch.setattr(cli_main, "build_parser", parser_with_interrupt)


@pytest.mark.usefixtures("interrupted_work")
def test_ctrl_c_on_every_subcommand_prints_one_line_and_exits_130(capsys):
    assert set(VALID) == subcommands(), "give each subcommand of `rapidfire --help` a command line"
    for name, argv in VALID.items():
        try:
            code = cli_main.main(argv)
        except KeyboardInterrupt:  # escaping here would also stop pytest itself
            pytest.fail(f"rapidfire {name}: KeyboardInterrupt escaped main()")
        captured = capsys.readouterr()
        assert code == 130, (name, code)
        assert captured.err == f"rapidfire {argv[0]}: interrupted\n", (name, captured.err)
        assert "Traceback" not in captured.out


@pytest.mark.usefixtures("interrupted_work")
def test_ctrl_c_with_debug_shows_the_traceback():
    with pytest.raises(KeyboardInterrupt):
        cli_main.main(["--debug", "env"])


def sigint_after(argv: list[str], ready: str, env=None) -> subprocess.CompletedProcess:
    """Run ``python -m rapidfire_hf ARGV``, send SIGINT once a stdout line contains ``ready``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rapidfire_hf", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for line in proc.stdout:
            if ready in line:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigint_on_a_training_demo_is_one_line_and_130(tmp_path):
    argv = ["demo", "--cpu", "--steps", "10000", "--output-dir", str(tmp_path)]
    proc = sigint_after(argv, ready="    1 ")  # the live table's line of update 1: training has started
    assert proc.returncode == 130, proc.stderr[-2000:]
    last = proc.stderr.splitlines()[-1]
    # the update in progress is finished and saved; the line names the checkpoint and the command that continues
    assert last.startswith("rapidfire demo: interrupted: PPOTrainer stopped by Ctrl-C (SIGINT) after update "), last
    saved = last.split("checkpoint saved in ")[1].split(";")[0]
    assert (tmp_path / saved.rpartition("/")[2] / "checkpoint_manifest.json").is_file(), last
    assert last.endswith(f"continue with `rapidfire demo --cpu --steps 10000 --output-dir {tmp_path} --resume`")
    assert "Traceback" not in proc.stderr + proc.stdout


METRICS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg")


def _curves(folder) -> dict:
    import csv

    with open(folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {k: [r[k] for r in rows] for k in METRICS}


@pytest.mark.slow
@pytest.mark.parametrize("sweep", [False, True], ids=["ppo", "sweep"])
def test_demo_ctrl_c_then_resume_equals_the_uninterrupted_demo(tmp_path, sweep):
    small = ["--cpu", "--steps", "4", "--batch-size", "8", "--response-length", "6"]
    small += ["--sweep", "kl_coef=0.01,0.2"] if sweep else []
    whole = subprocess.run(
        [sys.executable, "-m", "rapidfire_hf", "demo", *small, "--output-dir", str(tmp_path / "whole")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "cut"
    # Ctrl-C once the first update's line is out: the update in progress finishes and is saved
    proc = sigint_after(["demo", *small, "--output-dir", str(out)], ready="PPOSweep: " if sweep else "    1 ")
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "interrupted: " in proc.stderr.splitlines()[-1] and "--resume`" in proc.stderr.splitlines()[-1]
    again = subprocess.run(
        [sys.executable, "-m", "rapidfire_hf", "demo", *small, "--output-dir", str(out), "--resume"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    if sweep:
        import json

        def trials(folder):
            return {n: json.loads((folder / "trials" / n / "log_history.json").read_text())
                    for n in ("kl_coef=0.01", "kl_coef=0.2")}  # fmt: skip

        got, want = trials(out), trials(tmp_path / "whole")
        for name in want:
            assert [[h[k] for k in METRICS] for h in got[name]] == [[h[k] for k in METRICS] for h in want[name]]
    else:
        assert _curves(out) == _curves(tmp_path / "whole")


def test_sigint_on_a_watching_monitor_is_one_line_and_130(watched):  # noqa: F811
    pid, env = watched
    proc = sigint_after(["monitor", "--pid", str(pid), "--interval", "0.2", "--json"], str(pid), env=env)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == "rapidfire monitor: interrupted"
    assert "Traceback" not in proc.stderr
