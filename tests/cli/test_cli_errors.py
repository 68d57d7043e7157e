"""What a newcomer meets (issue 30): a mistake on any `rapidfire` subcommand is one message on stderr naming
the problem and the fix, exit status 2, never a traceback; `--debug` shows the traceback; a closed stdout
pipe is no error; the demo says how to monitor it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

import pytest

from rapidfire_hf.cli.main import build_parser, main
from rapidfire_hf.config import ConfigError

# one mistake per subcommand `rapidfire --help` lists: (argv, what the message must say); {tmp} is a
# temporary folder. argparse's own refusals (monitor, bench, env) exit 2 with a message too.
BAD_ARGUMENT = {
    "demo": (["demo", "--config", "nonexistent"], "--config nonexistent: unknown preset"),
    "plan": (["plan", "--batch", "6", "--micro", "4"], "--batch 6 is not divisible by --micro 4"),
    "sweep": (["sweep", "{tmp}/nonexistent.yaml"], "sweep file not found"),
    "monitor": (["monitor", "--pid", "1", "--interval", "0"], "seconds >= 0.1"),
    "bench": (["bench", "nosuch"], "invalid choice: 'nosuch'"),
    "env": (["env", "--bogus"], "unrecognized arguments: --bogus"),
    "config": (["config", "validate", "{tmp}/none.yaml"], "config file not found"),
}

SWEEP_YAML = """
reward_funcs: [REWARD]
config: {output_dir: OUT, max_steps: 1, use_cpu: true}
trials:
  a: {TRIAL_KEY: 0.1}
"""

# more of the mistakes a tester met: (argv or a sweep file's (reward, trial key), what the message must say)
MORE_MISTAKES = [
    (["demo", "--sweep", "foo=1,2"], "--sweep foo=1,2: foo is not a field a trial can set"),
    (["demo", "--sweep", "kl_cof=0.1,0.2"], "did you mean kl_coef?"),
    (["demo", "--steps", "0"], "--steps 0: must be at least 1"),
    (["sweep", "ctl", "--dir", "{tmp}", "stop"], "usage: rapidfire sweep ctl"),
    (("demo", "kl_cof"), "trials.a.kl_cof: unknown key (did you mean kl_coef?)"),
    (("'mymod:nofunc'", "kl_coef"), "reward_funcs: cannot import module 'mymod'"),
    (("'json:nofunc'", "kl_coef"), "reward_funcs: module 'json' has no 'nofunc'"),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``rapidfire ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refusing an argument
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def test_every_subcommand_refuses_a_bad_argument_in_one_line(tmp_path, capsys, monkeypatch):
    assert subcommands() == set(BAD_ARGUMENT), "give each subcommand of `rapidfire --help` a case"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # reward_funcs puts the current folder on sys.path
    for argv, says in BAD_ARGUMENT.values():
        code, out, err = run_cli([a.format(tmp=tmp_path) for a in argv], capsys)
        assert code == 2 and says in err and "Traceback" not in out + err, (argv, code, err)
    for what, says in MORE_MISTAKES:
        if isinstance(what, tuple):  # a sweep file
            reward, key = what
            spec = tmp_path / "sweep.yaml"
            text = SWEEP_YAML.replace("REWARD", reward).replace("TRIAL_KEY", key)
            spec.write_text(text.replace("OUT", str(tmp_path / "out")))
            argv = ["sweep", str(spec), "--no-progress"]
        else:
            argv = [a.format(tmp=tmp_path) for a in what]
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and says in err and "Traceback" not in out + err, (argv, code, err)
        assert "more characters" not in err and len(err.splitlines()) == 1, err
    # a missing sweep file is not offered a config preset name instead
    code, _, err = run_cli(["sweep", str(tmp_path / "nonexistent.yaml")], capsys)
    assert "preset" not in err and "docs/sweep.md" in err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError, match="sweep file not found"):
        main(["--debug", "sweep", str(tmp_path / "nonexistent.yaml")])


def test_a_real_console_sees_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rapidfire_hf", "sweep", str(tmp_path / "nonexistent.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rapidfire sweep: error: sweep file not found" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.usefixtures("single_thread")
def test_demo_prints_its_pid_and_the_monitor_command_first(tmp_path, capsys):
    argv = ["demo", "--steps", "1", "--batch-size", "4", "--response-length", "4", "--cpu"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        first
        == f"rapidfire demo: pid {os.getpid()}; watch its memory with: rapidfire monitor --pid {os.getpid()}"
    )


CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from rapidfire_hf.memory import TelemetryWriter, sample_memory

    telemetry = TelemetryWriter(sys.argv[1])
    telemetry.open()
    telemetry.memory(sample_memory(torch.nn.Linear(16, 16)), step=3, phase="train", where="step_end")
    print("ready", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """(pid, environment) of a process that registered a telemetry stream and lives for a while."""
    cache = tmp_path_factory.mktemp("rapidfire_cache")
    env = {**os.environ, "RAPIDFIRE_CACHE_DIR": str(cache)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cache / "telemetry")], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "ready"
    yield proc.pid, env
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("mode", [["--json"], []], ids=["json", "table"])
def test_monitor_into_a_pipe_that_closes_exits_quietly(watched, mode):
    pid, env = watched
    monitor = f"{sys.executable} -m rapidfire_hf monitor --pid {pid} --interval 0.1 {' '.join(mode)}"
    proc = subprocess.run(
        ["bash", "-c", f"{monitor} | head -1; exit ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.splitlines()) == 1 and str(pid) in proc.stdout
    for wrong in ("cannot read the telemetry stream", "Broken pipe", "Traceback", "Exception ignored"):
        assert wrong not in proc.stderr, proc.stderr[-2000:]


def test_monitor_table_redirected_to_a_file_is_written_while_watching(watched, tmp_path):
    pid, env = watched
    out = tmp_path / "monitor.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rapidfire_hf", "monitor", "--pid", str(pid), "--interval", "0.2"],
            stdout=f,
            stderr=subprocess.PIPE,
            env=env,
        )
    try:
        deadline = time.monotonic() + 60
        while "step / phase" not in out.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        assert f"rapidfire pid {pid}" in out.read_text()
    finally:
        proc.terminate()
        proc.wait()
