"""benchmarks/reproduce_h200.sh: every entry names a stored folder that exists (unless it says it was not
run yet), and every entry of the list has a command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reproduce_h200.sh"


def _entries() -> list[tuple[str, str, str]]:
    text = SCRIPT.read_text()
    block = text[text.index("ENTRIES=(") : text.index("\n)\n", text.index("ENTRIES=("))]
    return [tuple(m.split("|")) for m in re.findall(r'^\s+"([^"]+)"$', block, re.M)]


def test_each_entry_has_its_stored_folder_and_a_command():
    entries = _entries()
    assert len(entries) > 20
    text = SCRIPT.read_text()
    for name, stored, what in entries:
        assert re.search(rf"^\s+{re.escape(name)}\)", text, re.M), f"{name}: no command in entry()"
        if "not run yet" not in what:
            assert (ROOT / "benchmarks" / stored).exists(), (
                f"{name}: stored folder benchmarks/{stored} missing"
            )


def test_list_prints_every_entry():
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    assert [line.split()[0] for line in out.splitlines()[1:]] == [name for name, _, _ in _entries()]
