"""Every run.py command that benchmarks/reproduce_h200.sh would send to the GPU machine for a ppo_* entry
parses with run.py's own argument parser and selects at least one configuration (so a typo in an entry or
an ``--only`` prefix that matches nothing is found here, not after a device call). The script runs for
real with PYTHON set to a recorder that writes down each command line instead of running it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reproduce_h200.sh"


def _load_run():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("ppo_run", ROOT / "benchmarks" / "ppo_vs_trl" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded_commands(tmp_path: Path, entries: list[str]) -> list[list[str]]:
    log = tmp_path / "commands.jsonl"
    recorder = tmp_path / "python"
    recorder.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    recorder.chmod(0o755)
    env = {**os.environ, "PYTHON": str(recorder)}
    subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), *entries], env=env, capture_output=True, timeout=120
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_every_ppo_entry_command_parses_and_selects_a_configuration(tmp_path):
    entries = re.findall(r'^\s+"(ppo_[a-z0-9_]+)\|', SCRIPT.read_text(), re.M)
    assert "ppo_table_1b" in entries and "ppo_size7b_table" in entries
    commands = _recorded_commands(tmp_path, entries)
    run = _load_run()
    checked = 0
    for argv in commands:
        if not argv or not argv[0].endswith("ppo_vs_trl/run.py") or argv[1:2] == ["merge"]:
            continue
        args = run.parse_args(argv[1:])
        selected = [c["name"] for c in run.configs(args) if not args.only or c["name"].startswith(args.only)]
        assert selected, f"selects no configuration: {' '.join(argv)}"
        checked += 1
    # the 1.1B table is three calls; the 7B table runs its three entries' ten commands
    table = [a for a in commands if any("/ppo_table_1b/" in x for x in a) and a[0].endswith("run.py")]
    assert len(table) == 3
    assert checked >= 40


def test_the_default_run_leaves_out_two_gpu_and_repeating_entries(tmp_path):
    commands = _recorded_commands(tmp_path, [])
    outs = [x for argv in commands for x in argv if str(tmp_path / "out") in x]
    assert any("/ppo_size7b_lora_rm/" in x for x in outs)  # each 7B entry runs once, on its own
    assert not any("/ppo_size7b_table/" in x or "/dist_" in x for x in outs)
